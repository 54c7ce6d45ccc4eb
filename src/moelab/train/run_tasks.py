"""`moelab eval RUN --tasks` and `--retrieval`: a run's checkpoint restored and scored on tasks.

The run's newest (or a given) checkpoint is restored as the model ends its run (the last phase's
context and RoPE) and scored with the run's own tokenizer by ``moelab.eval.tasks`` (the task format
and its metrics); the results are saved in the run's evals/ folder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from moelab.config import final_model
from moelab.data.tokenizer import load_saved
from moelab.errors import UsageError
from moelab.eval.builtin import retrieval_examples
from moelab.eval.generation import GenTask, score_model
from moelab.eval.tasks import Example, load_tasks, model_loglik, score
from moelab.progress import say
from moelab.runs import load_run_config
from moelab.train.evaluate import restored


def evaluate_tasks(run_dir, files: Sequence[str], step: int | None = None, progress: bool = True, samples: int = 1,
                   temperature: float = 0.8, max_new: int = 128, seed: int = 0) -> dict:  # fmt: skip
    """`moelab eval RUN --tasks FILE...`: each task file scored by the run's newest (or a given)
    checkpoint with the run's own tokenizer; saved to evals/step_N-tasks.json (beside the tasks scored
    there before). A generation task
    (moelab.eval.generation) gets ``samples`` completions per prompt (one greedy, or k at
    ``temperature``) of at most ``max_new`` tokens: pass@1, and pass@k for k = samples."""
    if samples < 1:
        raise UsageError(f"--samples {samples}: must be at least 1 (1 = one greedy completion)")
    tasks = load_tasks(files)  # every file refused before anything loads
    run, cfg, store, state, step = restored(run_dir, step, progress)
    # the model as it ends its run: the last phase's context and RoPE
    m, tok = final_model(cfg), load_saved(store.path)
    loglik = model_loglik(state["params"], state["model_state"], m, tok)
    res = {"step": step, "tasks": {}}
    for name, examples in tasks.items():
        if examples and isinstance(examples[0], GenTask):
            say(f"{name}: {samples} completion(s) of each of {len(examples)} prompts, checked", progress)
            n = len(examples)

            def done(i: int, n: int = n) -> None:
                if (i + 1) % 16 == 0 and i + 1 < n:
                    say(f"  {i + 1}/{n} prompts written", progress)

            res["tasks"][name] = score_model(
                state["params"], state["model_state"], m, tok, examples, samples, temperature, max_new, seed, done
            )
            res["tasks"][name]["examples"] = len(examples)
            continue
        say(f"scoring {name}: {len(examples)} examples", progress)
        res["tasks"][name] = score(examples, loglik)
    (run.path / "evals").mkdir(exist_ok=True)
    path = run.path / "evals" / f"step_{step:08d}-tasks.json"
    try:  # the tasks scored before at this step stay beside these
        kept = {**json.loads(path.read_text()).get("tasks", {}), **res["tasks"]}
    except (OSError, ValueError, AttributeError):
        kept = res["tasks"]
    path.write_text(json.dumps({**res, "tasks": kept}, indent=1))
    return res


def evaluate_retrieval(
    run_dir,
    lengths: Sequence[int],
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    n: int = 16,
    step: int | None = None,
    progress: bool = True,
    seed: int = 0,
) -> dict:
    """`moelab eval RUN --retrieval LENGTHS`: the long-context retrieval task (moelab.eval.builtin:
    a key planted at each depth of held-out code, asked for at the end; chance 25%) generated for the
    run's tokenizer at each length in tokens, and scored by the run's newest (or a given) checkpoint
    as it ends its run (the last phase's context and RoPE). Saved to evals/step_N-retrieval.json."""
    context = final_model(load_run_config(run_dir)).seq_len  # refused before anything loads
    if bad := [x for x in lengths if not 16 <= x <= context]:
        raise UsageError(f"--retrieval: {bad[0]} tokens; give lengths from 16 to the model's context, {context}")
    if bad := [x for x in depths if not 0.0 <= x <= 1.0]:
        raise UsageError(f"--depths: {bad[0]}; depths are shares of the context, from 0.0 to 1.0")
    run, cfg, store, state, step = restored(run_dir, step, progress)
    tok = load_saved(store.path)
    loglik = model_loglik(state["params"], state["model_state"], final_model(cfg), tok, batch=16)

    def encode(text: str) -> list[int]:
        return tok.tokenizer.encode(text, add_special_tokens=False).ids

    res = {"step": step, "seq_len": context, "n": n, "chance": 0.25, "lengths": list(lengths), "depths": list(depths)}
    res["acc"], res["acc_norm"] = {}, {}
    for length in lengths:
        say(f"retrieval at {length} tokens: {n} examples at each of {len(depths)} depths", progress)
        # room for the start token and the answer's tokens within the context
        rows = retrieval_examples(n, length - 8, depths, seed, "code", encode)
        for depth in depths:
            exs = [Example(r["context"], tuple(r["choices"]), r["answer"]) for r in rows if r["meta"]["depth"] == depth]
            got = score(exs, loglik)
            res["acc"][f"{length}@{depth:g}"], res["acc_norm"][f"{length}@{depth:g}"] = got["acc"], got["acc_norm"]
    (run.path / "evals").mkdir(exist_ok=True)
    (run.path / "evals" / f"step_{step:08d}-retrieval.json").write_text(json.dumps(res, indent=1))
    return res
