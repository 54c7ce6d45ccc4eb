"""The static site: built only from what runs and journals wrote to disk."""
