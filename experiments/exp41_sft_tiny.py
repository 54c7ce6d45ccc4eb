"""The worked example of issue 41: pretrain tiny on the standard library, fine-tune it on a small
conversation set made offline from the standard library's docstrings, evaluate before and after.

Run it: moelab run experiments/exp41_sft_tiny.py   (about 3 minutes on 2 cores)

The conversations (``moelab.data.chat_examples``: "What does textwrap.dedent do?" answered by its
docstring's first paragraph, "What is the signature of ...?" by its signature) are written once to
the cache. The fine-tune reads them through moelab's chat template with the base run's tokenizer;
its loss and its held-out loss count the assistant's tokens only, and packed conversations attend
each only within itself. A second run trains on the same conversations from the seed, so the
record shows what pretraining brought (in bits per byte: the two runs' tokenizers differ).
"""

from pathlib import Path

from moelab.cache import cache_root
from moelab.data import chat_examples
from moelab.lab import Experiment, Prediction, output_of
from moelab.lab.steps import eval_step, finetune_step, train_step

CONVERSATIONS = Path(cache_root()) / "chat_examples" / "stdlib-docstrings.jsonl"
if not CONVERSATIONS.exists():
    chat_examples.write(CONVERSATIONS)

# 100 steps of 16 x 128 tokens read the 734 conversations about 4 times over (9 from the seed, with its own tokenizer)
CHAT = [f"data.sources=[{CONVERSATIONS}]", "data.text_field=messages", "train.eval_every=25", "data.epoch_cap=10"]
base = train_step("sft-base", "tiny", ["train.steps=300"])
sft = finetune_step("sft-stdlib", output_of(base), "tiny", ["train.steps=100", "train.lr=0.001", *CHAT])
# the same conversations from the seed (its own tokenizer: compare the two in bits per byte)
scratch = train_step("sft-scratch", "tiny", ["train.steps=100", "train.lr=0.001", *CHAT])
evaluate = eval_step("sft-eval", output_of(sft))

experiment = Experiment(
    issue=41,
    slug="sft_tiny",
    title="Tiny MoE fine-tuned on conversations: the assistant's held-out loss before and after",
    goal=(
        "Show pretraining, fine-tuning on conversations with an assistant-only loss, and evaluation as "
        "steps of one experiment on a laptop."
    ),
    hypothesis=(
        "100 steps of fine-tuning at a peak rate of 1e-3 on 734 docstring conversations bring the "
        "held-out loss on the assistant's tokens (dropless, macro) of a tiny model pretrained for 300 "
        "steps on the standard library to about 2.6 nats; a tiny model this small learns the answers' "
        "form (docstring prose, signatures) and the end of a turn, not which function does what."
    ),
    prediction=Prediction(
        metric="sft-eval:loss_dropless.macro",
        value=2.6,
        low=2.2,
        high=3.0,
        falsify_low=1.9,
        falsify_high=3.4,
        rule="falsified if the fine-tune's held-out assistant loss (dropless, macro) is outside [1.9, 3.4]",
    ),
    steps=[evaluate, scratch],
)
