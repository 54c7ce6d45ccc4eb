"""The token store's build against the tokenizer's own ``encode_batch`` over the same text (issue 26).

The corpus (benchmarks/make_corpus.py): ``--docs`` documents (default 5M, about 2.6 GB of text) cut
from the standard library's source and the C headers, lognormal lengths, in Parquet, ``.jsonl.zst``,
``.json.gz``, Arrow and a few plain text files, one folder (domain) per format. A byte-level BPE of
``--vocab`` tokens (default 8,192) is trained once on a sample of it and given to every build as
``data.tokenizer``, so no build trains.

1. **Speed** on a subset (``--subset-mb``, default 300 MB of text: the first shards of each
   format's folder). The reference: the subset's documents, read beforehand into memory as plain
   strings (the same documents the store keeps, in the same batches: 1 MiB of text or 8,192
   documents, cut at the same unit ends), fed to the tokenizer's ``encode_batch_fast`` and to its
   ``encode_batch`` (``add_special_tokens=False``); only the encoding is timed. The build:
   ``build_store`` over the subset's shards, timed whole (resolving, tokenizing, assembling). On
   1 core: RAYON_NUM_THREADS=1, the process pinned to one CPU (sched_setaffinity), the build with
   ``data.workers=1``; on all cores: the tokenizer's default threads, the build with
   ``data.workers=0``. Each run is a fresh process, in the order reference, build, build,
   reference; the ratio is the build's MB/s over the faster reference's, medians of the two runs.
2. **Memory** on the whole corpus: one build with ``data.workers=0`` (``--one-domain``: every folder
   in one domain). Peak RSS of the main process and of the largest worker as each process's VmHWM
   (/proc/<pid>/status: its high-water mark since its exec; getrusage's ru_maxrss is also recorded,
   but the kernel carries the forking parent's RSS into it across exec), read with the tree's RSS
   and PSS every 0.5 s (the largest sums over the tree). Its MB/s is set against the all-cores
   reference measured on the subset (the same corpus's first shards), not measured again on the
   whole corpus.
3. **Projection** (arithmetic, not a measurement): hours for 100 GB of text on this machine, on one
   16-, 64- and 192-core machine and on a Ray cluster of 10 x 64 cores, from the per-core MB/s
   measured here on all cores, assuming it holds per core as cores are added (a unit per core at a
   time, enough units, storage that keeps up), plus the assembly, which is serial (one process),
   scaled linearly from its time here.

Prints a table; writes benchmarks/results/data_pipeline.json (``--quick``: a smoke test of about a
minute on tiny sizes, written under ``--work`` instead). Progress lines go to stderr.
The prediction for the full-size run is in benchmarks/data_pipeline_prediction.md.

    python benchmarks/data_pipeline.py            # the full run: about 25 min on 2 cores, 5 GB of disk
    python benchmarks/data_pipeline.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
PROJECT_CORES = (16, 64, 192)
RAY_NODES, RAY_CORES = 10, 64
PROJECT_GB = 100


def log(msg: str) -> None:
    print(f"data_pipeline: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("+dirty(src)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    import tokenizers

    return {
        "nproc": len(os.sched_getaffinity(0)),
        "os_cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "python": platform.python_version(),
        "tokenizers": tokenizers.__version__,
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
    }


# ---------------------------------------------------------------- sampling a process tree


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (/proc/<pid>/task/*/children)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                out += [int(x) for x in fh.read().split()]
        except OSError:
            continue
    return out


def _tree(root: int) -> list[int]:
    """``root`` and its descendants."""
    out, frontier = [root], [root]
    while frontier:
        frontier = [c for p in frontier for c in _children(p)]
        out += frontier
    return out


def _status(pid: int) -> tuple[int, int, int] | None:
    """(RSS, its high-water mark since the process's exec, PSS) in bytes."""
    rss = hwm = None
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
                elif line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return None
    if rss is None or hwm is None:
        return None
    pss = rss
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            for line in fh:
                if line.startswith(b"Pss:"):
                    pss = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return rss, hwm, pss


def vm_hwm() -> int:
    """This process's peak RSS since its exec (getrusage's ru_maxrss would include the RSS of the
    process it was forked from, as the kernel keeps it across exec)."""
    s = _status(os.getpid())
    return s[1] if s else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Sampler(threading.Thread):
    """The process tree every ``every`` seconds: each process's peak RSS (VmHWM, exact since its
    exec, read while it lives), the largest sums of RSS and of PSS over the tree, and a timeline."""

    def __init__(self, pid: int, every: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.stop = threading.Event()
        self.hwm: dict[int, int] = {}
        self.max_sum_rss = self.max_sum_pss = self.max_procs = 0
        self.timeline: list[tuple[float, int, int, int]] = []  # (s, processes, sum RSS, sum PSS)
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop.is_set():
            rss_sum = pss_sum = n = 0
            for p in _tree(self.pid):
                m = _status(p)
                if m is None:
                    continue
                n += 1
                rss_sum += m[0]
                pss_sum += m[2]
                self.hwm[p] = max(self.hwm.get(p, 0), m[1])
            self.max_sum_rss = max(self.max_sum_rss, rss_sum)
            self.max_sum_pss = max(self.max_sum_pss, pss_sum)
            self.max_procs = max(self.max_procs, n)
            self.timeline.append((round(time.monotonic() - self.t0, 1), n, rss_sum, pss_sum))
            self.stop.wait(self.every)

    def summary(self) -> dict:
        step = max(1, len(self.timeline) // 120)
        others = [v for p, v in self.hwm.items() if p != self.pid]
        return {
            "sampled_every_s": self.every,
            "peak_rss_main_gb": gb(self.hwm.get(self.pid, 0)),
            "peak_rss_largest_other_gb": gb(max(others, default=0)),
            "max_rss_sum_gb": gb(self.max_sum_rss),
            "max_pss_sum_gb": gb(self.max_sum_pss),
            "max_processes": self.max_procs,
            "timeline_s_procs_rss_gb_pss_gb": [(t, n, gb(r), gb(p)) for t, n, r, p in self.timeline[::step]],
        }


def gb(n: float) -> float:
    return round(n / 1e9, 3)


# ---------------------------------------------------------------- the child processes


def _config(spec: dict):
    from moelab.config import load_config

    return load_config(
        "tiny",
        [
            f"data.sources={json.dumps(spec['sources'])}",
            f"data.tokenizer={spec['tokenizer']}",
            f"model.vocab_size={spec['vocab']}",
            f"data.workers={spec['workers']}",
            "data.max_bytes_per_domain=0",
        ],
    )


def _batches(cfg) -> tuple[list[list[str]], int]:
    """The documents the store keeps, as the store's workers batch them (per unit: up to 1 MiB of
    text or 8,192 documents), and their UTF-8 bytes."""
    from moelab.data import sources as S
    from moelab.data import store as ST

    domains, vdomains = ST.resolve_all(cfg.data)
    all_domains = domains + vdomains
    batches: list[list[str]] = []
    nbytes = 0
    for unit in ST.plan_units(all_domains):
        dom = all_domains[unit.domain]
        texts: list[str] = []
        chars = 0
        for si in unit.shards:
            for doc in S.iter_shard(dom, dom.shards[si], S.Bad(skip=cfg.data.bad_records == "skip"), []):
                if not doc.text.strip():
                    continue
                for piece in S.pieces(doc, S.MAX_PIECE_CHARS):
                    t = piece.text
                    texts.append(t)
                    nbytes += len(t) if t.isascii() else len(t.encode("utf-8"))
                    chars += len(t)
                    if chars >= ST.ENCODE_BATCH_CHARS or len(texts) >= ST.ENCODE_BATCH_DOCS:
                        batches.append(texts)
                        texts, chars = [], 0
        if texts:
            batches.append(texts)
    return batches, nbytes


def child_reference(spec: dict) -> dict:
    from moelab.data import tokenizer as T

    cfg = _config(spec)
    t0 = time.perf_counter()
    batches, nbytes = _batches(cfg)
    load_s = time.perf_counter() - t0
    docs = sum(map(len, batches))
    tok = T.load(cfg.data.tokenizer, spec["vocab"]).tokenizer
    print(f"data_pipeline:   reference: {docs:,} documents ({nbytes / 1e6:.1f} MB) in memory in {load_s:.1f} s; "
          f"encoding ({' then '.join(spec['methods'])})", file=sys.stderr, flush=True)  # fmt: skip
    out = {"documents": docs, "bytes": nbytes, "load_seconds": round(load_s, 2)}
    for method in spec["methods"]:
        fn = tok.encode_batch_fast if method == "encode_batch_fast" else tok.encode_batch
        tokens = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for batch in batches:
            enc = fn(batch, add_special_tokens=False)
            tokens += sum(map(len, enc))
            del enc
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0  # every thread of this process
        out[method] = {"seconds": seconds, "tokens": tokens, "cpu_seconds": round(cpu, 2)}
        print(f"data_pipeline:   {method}: {out[method]['seconds']:.1f} s, {nbytes / 1e6 / out[method]['seconds']:.2f} MB/s",
              file=sys.stderr, flush=True)  # fmt: skip
    return out


def child_build(spec: dict) -> dict:
    from moelab.data import store as ST

    phases: dict[str, float] = {}
    returned: dict[str, object] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                returned[name] = fn(*a, **k)
                return returned[name]
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    def cpu(who) -> float:
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime

    ST._run_units = timed("tokenize", ST._run_units)  # the phases' times (this process only)
    ST._assemble = timed("assemble", ST._assemble)
    cfg = _config(spec)
    t0, c_self, c_children = time.perf_counter(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    store = ST.build_store(cfg.data, spec["vocab"], cache=Path(spec["cache"]), progress=True)
    seconds = time.perf_counter() - t0
    c_self, c_children = cpu(resource.RUSAGE_SELF) - c_self, cpu(resource.RUSAGE_CHILDREN) - c_children
    done = returned.get("tokenize") or {}
    m = store.manifest
    stats = m["stats"]
    documents = sum(s["train"]["documents"] + s["heldout"]["documents"] for s in stats.values())
    nbytes = sum(s["train"]["bytes"] + s["heldout"]["bytes"] for s in stats.values())
    build = json.loads((store.path / "build.json").read_text())
    return {
        "seconds": seconds,
        "build_json_seconds": build.get("seconds"),
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "documents": documents,
        "bytes": nbytes,
        "tokens": int(m["n_tokens"]),
        "units": len(m["units"]),
        "unit_text_mb": [round(done[i]["bytes"] / 1e6, 1) for i in sorted(done)],  # in the order they were queued
        "cpu_seconds": {"main": round(c_self, 2), "workers": round(c_children, 2)},
        # the workers' largest ru_maxrss: it includes this process's RSS when the worker was forked
        "ru_maxrss_children_gb": gb(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024),
    }


def child_main(spec: dict) -> None:
    if spec.get("cpu") is not None:
        os.sched_setaffinity(0, {spec["cpu"]})
    fn = {"reference": child_reference, "build": child_build, "tokenizer": child_tokenizer}[spec["kind"]]
    out = fn(spec)
    out["peak_rss_self_gb"] = gb(vm_hwm())
    print("RESULT " + json.dumps(out), flush=True)


def run_child(spec: dict, threads: int | None, sample: bool = True) -> dict:
    """``spec`` in a fresh process: RAYON_NUM_THREADS=threads (None: the tokenizer's default)."""
    env = dict(os.environ)
    env.pop("RAYON_NUM_THREADS", None)
    env.pop("TOKENIZERS_PARALLELISM", None)
    if threads is not None:
        env["RAYON_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                            env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
    sampler = Sampler(proc.pid) if sample else None
    if sampler:
        sampler.start()
    stdout, _ = proc.communicate()
    if sampler:
        sampler.stop.set()
        sampler.join()
    if proc.returncode != 0:
        sys.exit(f"data_pipeline: the {spec['kind']} process failed (exit {proc.returncode})")
    line = next(ln for ln in reversed(stdout.splitlines()) if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    out["process_seconds"] = round(time.perf_counter() - t0, 2)
    if sampler:
        out["sampled"] = sampler.summary()
    return out


# ---------------------------------------------------------------- the phases


def tokenizer_folder(manifest: dict, vocab: int, sample_mb: float, work: Path) -> Path:
    import hashlib

    key = hashlib.sha256(json.dumps([manifest["params"], vocab, sample_mb]).encode()).hexdigest()[:12]
    return work / f"tokenizer-{vocab}-{key}"


def child_tokenizer(spec: dict) -> dict:
    """A byte-level BPE trained on the first ``sample_mb`` of text of each format's folder, in
    proportion to the formats' shares, saved into ``folder``."""
    from moelab.data import sources as S
    from moelab.data import tokenizer as T

    corpus, manifest = Path(spec["corpus"]), json.loads((Path(spec["corpus"]) / "corpus.json").read_text())
    share: dict[str, int] = {}
    for s in manifest["shards"]:
        share[s["format"]] = share.get(s["format"], 0) + s["text_bytes"]
    total = sum(share.values())

    def texts():
        for fmt, nbytes in share.items():
            (dom,) = S.resolve([f"{fmt}={corpus / fmt}"])
            budget, seen = spec["sample_mb"] * 1e6 * nbytes / total, 0
            for doc in S.iter_documents(dom):
                if seen >= budget:
                    break
                seen += len(doc.text)
                yield doc.text

    t0 = time.time()
    tok = T.train(texts(), spec["vocab"])
    folder = Path(spec["folder"])
    tmp = folder.parent / f".{folder.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    T.save(tok, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return {"seconds": round(time.time() - t0, 1)}


def train_tokenizer(corpus: Path, manifest: dict, vocab: int, sample_mb: float, work: Path) -> Path:
    """The tokenizer every run is given (trained once in a fresh process, then reused)."""
    folder = tokenizer_folder(manifest, vocab, sample_mb, work)
    if (folder / "tokenizer.json").is_file():
        log(f"reusing the {vocab}-token tokenizer in {folder}")
        return folder
    log(f"training a {vocab}-token byte-level BPE on {sample_mb:g} MB of the corpus (once; cached in {folder})")
    out = run_child({"kind": "tokenizer", "corpus": str(corpus), "vocab": vocab, "sample_mb": sample_mb,
                     "folder": str(folder)}, None, sample=False)  # fmt: skip
    log(f"  trained in {out['seconds']:.0f} s")
    return folder


def subset_sources(corpus: Path, manifest: dict, subset_mb: float) -> tuple[list[str], dict]:
    """The first shards of each format's folder, about its share of ``subset_mb`` of text (at least
    one shard each), and the text folder whole."""
    by_fmt: dict[str, list[dict]] = {}
    for s in manifest["shards"]:
        by_fmt.setdefault(s["format"], []).append(s)
    total = manifest["text_bytes"]
    sources, nbytes, docs, shards = [], 0, 0, 0
    for fmt, items in by_fmt.items():
        if fmt == "text":
            chosen = items
            sources.append(f"text={corpus / 'text'}")
        else:
            want = subset_mb * 1e6 * sum(s["text_bytes"] for s in items) / total
            chosen, got = [], 0
            for s in items:
                if chosen and abs(got + s["text_bytes"] - want) >= abs(got - want):
                    break
                chosen.append(s)
                got += s["text_bytes"]
            sources += [f"{fmt}={corpus / s['path']}" for s in chosen]
        nbytes += sum(s["text_bytes"] for s in chosen)
        docs += sum(s["documents"] for s in chosen)
        shards += len(chosen) if fmt != "text" else chosen[0]["documents"]
    return sources, {"documents": docs, "text_bytes": nbytes, "shards": shards}


def fifo_balance(unit_sizes: list[float], workers: int) -> float:
    """The share of the workers' time spent working when units, in order, go to the first free
    worker and take time in proportion to their size: the tail of the last units is the rest."""
    free = [0.0] * max(1, min(workers, len(unit_sizes)))
    for size in unit_sizes:
        i = free.index(min(free))
        free[i] += size
    return sum(unit_sizes) / (len(free) * max(free)) if unit_sizes and max(free) > 0 else 1.0


def speed(label: str, base: dict, cpu: int | None, threads: int | None, workers: int, cache: Path) -> dict:
    """reference, build, build, reference, each in a fresh process."""
    runs = []
    order = ["reference", "build", "build", "reference"]
    refs = 0
    for i, kind in enumerate(order):
        spec = dict(base, kind=kind, cpu=cpu, workers=workers)
        if kind == "reference":
            methods = ["encode_batch_fast", "encode_batch"]
            spec["methods"] = methods if refs % 2 == 0 else methods[::-1]
            refs += 1
        else:
            spec["cache"] = str(cache / f"{label.replace(' ', '_')}-{i}")
        log(f"[{label}] run {i + 1}/4: {kind}" + (f" ({', '.join(spec['methods'])})" if kind == "reference" else
            f" (data.workers={workers})"))  # fmt: skip
        out = run_child(spec, threads)
        if kind == "build":
            shutil.rmtree(spec["cache"], ignore_errors=True)
            log(f"  build: {out['seconds']:.1f} s, {out['bytes'] / 1e6 / out['seconds']:.2f} MB/s "
                f"(tokenize {out['phases_s'].get('tokenize', 0):.1f} s, assemble {out['phases_s'].get('assemble', 0):.1f} s), "
                f"peak RSS {out['peak_rss_self_gb']:.2f} GB")  # fmt: skip
        out["kind"] = kind
        runs.append(out)
    ref = [r for r in runs if r["kind"] == "reference"]
    bld = [r for r in runs if r["kind"] == "build"]
    nbytes, docs = ref[0]["bytes"], ref[0]["documents"]
    fast = statistics.median(r["encode_batch_fast"]["seconds"] for r in ref)
    plain = statistics.median(r["encode_batch"]["seconds"] for r in ref)
    build = statistics.median(r["seconds"] for r in bld)
    best = min(fast, plain)
    ref_tokens = ref[0]["encode_batch_fast"]["tokens"]
    same = bld[0]["documents"] == docs and bld[0]["tokens"] == ref_tokens + docs
    if not same:
        log(f"  WARNING: the build kept {bld[0]['documents']:,} documents and {bld[0]['tokens']:,} tokens; the reference "
            f"{docs:,} documents and {ref_tokens:,} tokens (+{docs:,} end-of-text)")  # fmt: skip
    ncores = 1 if cpu is not None else len(os.sched_getaffinity(0))
    unit_mb = bld[0]["unit_text_mb"]
    return {
        "cores": ncores,
        "rayon_threads": threads or "default",
        "data_workers": workers,
        "documents": docs,
        "text_mb": round(nbytes / 1e6, 2),
        "tokens_with_eot": bld[0]["tokens"],
        "same_documents_and_tokens": same,
        "median_seconds": {
            "encode_batch_fast": round(fast, 2),
            "encode_batch": round(plain, 2),
            "build": round(build, 2),
        },
        "mb_per_s": {
            "encode_batch_fast": round(nbytes / 1e6 / fast, 3),
            "encode_batch": round(nbytes / 1e6 / plain, 3),
            "build": round(nbytes / 1e6 / build, 3),
        },
        "tokens_per_s": {
            "encode_batch_fast": round(ref_tokens / fast),
            "encode_batch": round(ref_tokens / plain),
            "build": round(bld[0]["tokens"] / build),
        },
        "documents_per_s": {"encode_batch_fast": round(docs / fast), "build": round(docs / build)},
        "ratio": round(best / build, 3),
        "ratio_vs": "encode_batch_fast" if fast <= plain else "encode_batch",
        "per_core_mb_per_s_build": round(nbytes / 1e6 / build / ncores, 3),
        "units": len(unit_mb),
        "unit_text_mb": unit_mb,
        "cpu_busy": {  # CPU seconds over cores x wall seconds, medians
            "encode_batch_fast": round(
                statistics.median(r["encode_batch_fast"]["cpu_seconds"] for r in ref) / ncores / fast, 3
            ),
            "build": round(statistics.median(sum(r["cpu_seconds"].values()) for r in bld) / ncores / build, 3),
        },
        "fifo_balance_estimate": round(fifo_balance(unit_mb, workers or ncores), 3),
        "runs": [
            {k: v for k, v in r.items() if k not in ("unit_text_mb",)}
            | (
                {"sampled": {k: v for k, v in r["sampled"].items() if not k.startswith("timeline")}}
                if "sampled" in r
                else {}
            )
            for r in runs
        ],
    }


def projection(all_cores: dict, memory: dict | None, ncores: int) -> dict:
    """Hours for PROJECT_GB of text from the per-core MB/s measured on all cores here."""
    src = memory or all_cores
    per_core = src["tokenize_mb_per_s"] / ncores if memory else all_cores["per_core_mb_per_s_build"]
    assemble_s_per_gb = memory["assemble_s_per_gb"] if memory else 0.0
    mb = PROJECT_GB * 1e3

    def hours(cores: int) -> float:
        return round((mb / (per_core * cores) + assemble_s_per_gb * PROJECT_GB) / 3600, 2)

    rows = {f"this machine ({ncores} cores)": hours(ncores)}
    rows |= {f"one {c}-core machine": hours(c) for c in PROJECT_CORES}
    rows[f"Ray cluster, {RAY_NODES} x {RAY_CORES} cores"] = hours(RAY_NODES * RAY_CORES)
    return {
        "text_gb": PROJECT_GB,
        "per_core_mb_per_s": round(per_core, 3),
        "assemble_s_per_gb_serial": round(assemble_s_per_gb, 1),
        "hours": rows,
        "assumption": (
            "a projection, not a measurement: the tokenizing time is the text over (per-core MB/s measured here "
            "on all cores x cores), i.e. linear in cores while per-core throughput holds (one unit per core at a "
            "time, many more units than cores, storage and memory bandwidth that keep up, no Ray task overhead); "
            "the assembly (one process writing the store) is serial and scaled linearly from its time here"
        ),
    }


def memory_phase(corpus: Path, manifest: dict, base: dict, cache: Path, one_domain: bool) -> dict:
    """The whole corpus: a domain per format's folder, or (``one_domain``) every folder in one domain,
    the assembly's worst case (it holds a domain's document index at a time)."""
    sources = [f"{'all' if one_domain else fmt}={corpus / fmt}" for fmt in manifest["folders"]]
    spec = dict(base, kind="build", sources=sources, cpu=None, workers=0, cache=str(cache / "memory"))
    log(f"memory: building the store of the whole corpus ({manifest['documents']:,} documents, "
        f"{manifest['text_bytes'] / 1e9:.2f} GB of text, {len(manifest['shards'])} shards) with data.workers=0")  # fmt: skip
    out = run_child(spec, None)
    shutil.rmtree(spec["cache"], ignore_errors=True)
    tok_s = out["phases_s"].get("tokenize", out["seconds"])
    asm_s = out["phases_s"].get("assemble", 0.0)
    out["mb_per_s"] = round(out["bytes"] / 1e6 / out["seconds"], 3)
    out["tokenize_mb_per_s"] = round(out["bytes"] / 1e6 / tok_s, 3)
    out["assemble_s_per_gb"] = round(asm_s / (out["bytes"] / 1e9), 2) if out["bytes"] else 0.0
    out["tokens_per_s"] = round(out["tokens"] / out["seconds"])
    out["documents_per_s"] = round(out["documents"] / out["seconds"])
    out["fifo_balance_estimate"] = round(fifo_balance(out["unit_text_mb"], len(os.sched_getaffinity(0))), 3)
    out["cpu_busy"] = round(sum(out["cpu_seconds"].values()) / len(os.sched_getaffinity(0)) / out["seconds"], 3)
    return out


# ---------------------------------------------------------------- the report


def table(res: dict) -> str:
    lines = []
    sp = res["speed"]
    lines.append(f"{'':28} {'1 core':>14} {'all cores (' + str(sp['all cores']['cores']) + ')':>16}")
    one, allc = sp["1 core"], sp["all cores"]

    def row(name, f):
        lines.append(f"{name:28} {f(one):>14} {f(allc):>16}")

    row("encode_batch_fast MB/s", lambda s: f"{s['mb_per_s']['encode_batch_fast']:.2f}")
    row("encode_batch MB/s", lambda s: f"{s['mb_per_s']['encode_batch']:.2f}")
    row("build MB/s", lambda s: f"{s['mb_per_s']['build']:.2f}")
    row("ratio (build / faster)", lambda s: f"{s['ratio']:.3f}x")
    row("encode_batch_fast tokens/s", lambda s: f"{s['tokens_per_s']['encode_batch_fast']:,}")
    row("build tokens/s (with EOT)", lambda s: f"{s['tokens_per_s']['build']:,}")
    row("build documents/s", lambda s: f"{s['documents_per_s']['build']:,}")
    row("build seconds (median)", lambda s: f"{s['median_seconds']['build']:.1f}")
    row(
        "reference seconds (faster)",
        lambda s: f"{min(s['median_seconds']['encode_batch_fast'], s['median_seconds']['encode_batch']):.1f}",
    )
    row("units (balance estimate)", lambda s: f"{s['units']} ({s['fifo_balance_estimate']:.2f})")
    row(
        "CPU busy: reference / build",
        lambda s: f"{s['cpu_busy']['encode_batch_fast']:.2f} / {s['cpu_busy']['build']:.2f}",
    )
    lines.append(f"subset: {one['documents']:,} documents, {one['text_mb']:.0f} MB of text; target ratio >= 0.8")
    mem = res.get("memory")
    if mem:
        smp = mem["sampled"]
        lines.append("")
        lines.append(f"whole corpus, data.workers=0: {mem['documents']:,} documents, {mem['bytes'] / 1e9:.2f} GB of text, "
                     f"{mem['tokens']:,} tokens in {mem['seconds']:.0f} s")  # fmt: skip
        lines.append(f"  {mem['mb_per_s']:.2f} MB/s ({mem['tokens_per_s']:,} tokens/s, {mem['documents_per_s']:,} documents/s); "
                     f"ratio to the subset's all-cores reference {mem['ratio_to_reference']:.3f}x")  # fmt: skip
        lines.append(
            f"  phases: tokenize {mem['phases_s'].get('tokenize', 0):.0f} s, assemble {mem['phases_s'].get('assemble', 0):.0f} s; "
            f"{mem['units']} units, {mem['domains']} domains; CPU busy {mem['cpu_busy']:.2f}"
        )
        lines.append(f"  peak RSS: main {mem['peak_rss_self_gb']:.2f} GB, largest worker {smp['peak_rss_largest_other_gb']:.2f} GB "
                     f"(VmHWM); the tree's largest sum: RSS {smp['max_rss_sum_gb']:.2f} GB, "
                     f"sum PSS {smp['max_pss_sum_gb']:.2f} GB; target: under 2 GB")  # fmt: skip
    pj = res["projection"]
    lines.append("")
    lines.append(f"projection for {pj['text_gb']} GB of text ({pj['per_core_mb_per_s']:.2f} MB/s per core, "
                 f"assembly {pj['assemble_s_per_gb_serial']:.0f} s/GB serial), not measured:")  # fmt: skip
    for k, v in pj["hours"].items():
        lines.append(f"  {k:34} {v:8.2f} h")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of about a minute")
    ap.add_argument(
        "--docs", type=int, default=None, help="documents in the corpus (default 5,000,000; --quick 40,000)"
    )
    ap.add_argument(
        "--subset-mb", type=float, default=None, help="text of the speed subset, MB (default 300; --quick 8)"
    )
    ap.add_argument("--vocab", type=int, default=8192, help="tokenizer size (default 8,192)")
    ap.add_argument(
        "--tokenizer-sample-mb", type=float, default=None, help="text the tokenizer learns from (default 32; --quick 4)"
    )
    ap.add_argument("--shard-docs", type=int, default=None, help="documents per shard (default 65,536; --quick 4,096)")
    ap.add_argument(
        "--work",
        default="runs/bench/data_pipeline",
        help="corpus, tokenizer and stores (kept: the corpus, the tokenizer)",
    )
    ap.add_argument("--skip-memory", action="store_true", help="leave out the whole-corpus build")
    ap.add_argument(
        "--one-domain",
        action="store_true",
        help="the whole-corpus build with every folder in one domain (default: one each)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="the results file (default benchmarks/results/data_pipeline.json; --quick: under --work)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(json.loads(args.child))
        return

    q = args.quick
    docs = args.docs or (40_000 if q else 5_000_000)
    subset_mb = args.subset_mb or (8.0 if q else 300.0)
    sample_mb = args.tokenizer_sample_mb or (4.0 if q else 32.0)
    shard_docs = args.shard_docs or (4096 if q else 65536)
    work = Path(args.work).resolve() / ("quick" if q else "full")
    out_path = (
        Path(args.out) if args.out else (work / "data_pipeline_quick.json" if q else RESULTS / "data_pipeline.json")
    )
    ncores = len(os.sched_getaffinity(0))
    cpu1 = max(os.sched_getaffinity(0))
    t_start = time.time()
    log(f"{'quick smoke test' if q else 'full run'}: {docs:,} documents, a {subset_mb:g} MB subset, a {args.vocab}-token "
        f"tokenizer, {ncores} cores; work folder {work}")  # fmt: skip

    log("phase 1/5: the corpus")
    corpus = work / f"corpus-{docs}"
    cmd = [sys.executable, str(HERE / "make_corpus.py"), "--docs", str(docs), "--out", str(corpus), "--seed", "0",
           "--shard-docs", str(shard_docs), "--row-group", str(min(8192, max(256, shard_docs // 8)))]  # fmt: skip
    if subprocess.run(cmd).returncode != 0:  # its own process: this one stays small (see vm_hwm)
        sys.exit("data_pipeline: making the corpus failed")
    manifest = json.loads((corpus / "corpus.json").read_text())

    log("phase 2/5: the tokenizer")
    tok_dir = train_tokenizer(corpus, manifest, args.vocab, sample_mb, work)

    sources, sub = subset_sources(corpus, manifest, subset_mb)
    log(
        f"the speed subset: {sub['documents']:,} documents, {sub['text_bytes'] / 1e6:.1f} MB of text, {sub['shards']} shards"
    )
    base = {"sources": sources, "tokenizer": str(tok_dir), "vocab": args.vocab}
    cache = work / "stores"
    shutil.rmtree(cache, ignore_errors=True)

    log(f"phase 3/5: speed on 1 core (CPU {cpu1}, RAYON_NUM_THREADS=1, data.workers=1)")
    one = speed("1 core", base, cpu1, 1, 1, cache)
    log(f"  1 core: build {one['mb_per_s']['build']:.2f} MB/s, encode_batch_fast {one['mb_per_s']['encode_batch_fast']:.2f} MB/s, "
        f"ratio {one['ratio']:.3f}")  # fmt: skip
    log(f"phase 4/5: speed on all {ncores} cores (default threads, data.workers=0)")
    allc = speed("all cores", base, None, None, 0, cache)
    log(f"  all cores: build {allc['mb_per_s']['build']:.2f} MB/s, encode_batch_fast {allc['mb_per_s']['encode_batch_fast']:.2f} MB/s, "
        f"ratio {allc['ratio']:.3f}")  # fmt: skip

    mem = None
    if not args.skip_memory:
        log("phase 5/5: memory, the whole corpus")
        mem = memory_phase(corpus, manifest, base, cache, args.one_domain)
        mem["domains"] = 1 if args.one_domain else len(manifest["folders"])
        ref_mbps = max(allc["mb_per_s"]["encode_batch_fast"], allc["mb_per_s"]["encode_batch"])
        mem["ratio_to_reference"] = round(mem["mb_per_s"] / ref_mbps, 3)
        mem["reference"] = (
            "the all-cores reference measured on the speed subset (the first shards of this corpus), not on the whole corpus"
        )
    shutil.rmtree(cache, ignore_errors=True)

    res = {
        "date": date.today().isoformat(),
        "quick": q,
        "machine": machine(),
        "git_commit": git_commit(),
        "recipe": {
            "documents": docs,
            "subset_mb": subset_mb,
            "vocab": args.vocab,
            "tokenizer_sample_mb": sample_mb,
            "shard_docs": shard_docs,
            "batches": "per unit: 1 MiB of text or 8,192 documents (the store's ENCODE_BATCH_CHARS / ENCODE_BATCH_DOCS)",
            "order": "reference, build, build, reference; fresh process each",
            "reference_methods_order": "run 1: encode_batch_fast then encode_batch; run 2: the reverse",
        },
        "corpus": {k: manifest[k] for k in ("documents", "text_bytes", "file_bytes", "seconds")}
        | {
            "formats": {
                f: {
                    "shards": sum(1 for s in manifest["shards"] if s["format"] == f),
                    "documents": sum(s["documents"] for s in manifest["shards"] if s["format"] == f),
                    "text_bytes": sum(s["text_bytes"] for s in manifest["shards"] if s["format"] == f),
                    "file_bytes": sum(s["file_bytes"] for s in manifest["shards"] if s["format"] == f),
                }
                for f in manifest["folders"]
            }
        },
        "subset": sub,
        "speed": {"1 core": one, "all cores": allc},
        "memory": mem,
        "projection": projection(allc, mem, ncores),
        "wall_minutes": round((time.time() - t_start) / 60, 1),
    }
    print(table(res))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    log(f"wrote {out_path} ({res['wall_minutes']:.1f} min in all)")


if __name__ == "__main__":
    main()
