"""lm-evaluation-harness against `fivefold serve`, checked by lm-evaluation-harness itself.

The same multiple-choice task is scored twice in one run: by lm-eval's `local-completions` model over the
server's `echo` + `logprobs` (its tokenizer through the server's /tokenize, no copy of it), and by lm-eval's
`hf` model (transformers) on the Hugging Face export of the same weights. Printed: each side's accuracy, the
largest difference between their per-choice log-likelihoods, how many choices' is-greedy flags differ, and
each side's wall time (the ratio is a by-product, not the point: the `hf` side scores in padded batches).

The task is written here (no dataset download): questions whose answers a model trained on the embedded
corpus could know, or a random-weight model cannot. lm-eval is not a fivefold dependency:

    pip install lm-eval            # in the environment fivefold is installed in
    python bench/lm_eval_check.py [--run RUN] [--out bench/results/lm_eval_cpu.json]

Without --run, a random-weight `tiny` model with a tokenizer trained on the embedded corpus is used.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASK = "fivefold_mc"
SUBJECTS = ["the list", "a dict", "the loop", "this function", "the class", "a string", "the file", "that tuple"]
VERBS = [" returns", " holds", " opens", " calls", " prints", " sorts", " reads", " yields"]


def docs() -> list[dict]:
    """64 four-way questions: a subject, then which verb follows it (the gold one by a fixed rule)."""
    out = []
    for i in range(64):
        subject = SUBJECTS[i % len(SUBJECTS)]
        choices = [VERBS[(i + k) % len(VERBS)] for k in range(4)]
        out.append({"question": f"In Python, {subject}", "choices": choices, "gold": i % 4})
    return out


def write_task(directory: Path) -> None:
    (directory / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs()))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {directory / 'data.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: gold\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(run: str | None, directory: Path) -> tuple[Path, Path]:
    """(what `fivefold serve` loads, the Hugging Face export of the same weights, tokenizer included)."""
    from fivefold.checkpoint.store import save_model
    from fivefold.config import Config
    from fivefold.interop.hf import export_hf, read_tokenizer_files, with_tokenizer_config

    if run:
        from fivefold.checkpoint.store import resolve_checkpoint
        from fivefold.weights import load_model

        source = resolve_checkpoint(run)
        _, model = load_model(source)
        files = read_tokenizer_files(source)
    else:
        from fivefold.data.corpus import embedded_documents
        from fivefold.data.tokenizer import train_tokenizer
        from fivefold.model import build_model
        from fivefold.presets import PRESETS

        model = build_model(PRESETS["tiny"], seed=0)
        tokenizer = train_tokenizer(embedded_documents()[:300], PRESETS["tiny"].vocab_size)
        files = {"tokenizer.json": tokenizer.to_str().encode()}
        source = directory / "checkpoint"
        save_model(source, Config(model=PRESETS["tiny"]), model, extra_files=files)
    hf = export_hf(model, directory / "hf", extra_files=with_tokenizer_config(model.cfg, files))
    return source, hf


def evaluate(model: str, model_args: str, include: Path) -> tuple[dict, list[dict], float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                                  task_manager=TaskManager(include_path=str(include)), device="cpu")
    return out["results"][TASK], out["samples"][TASK], time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="a fivefold run or checkpoint (default: a random-weight tiny model)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_task(tmp)
        source, hf = make_model(args.run, tmp)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "fivefold", "serve", str(source), "--port", str(port),
                                   "--model-name", "m", "--device", "cpu"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        try:
            import requests

            for _ in range(600):
                try:
                    if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                        break
                except requests.RequestException:
                    time.sleep(0.2)
            else:
                raise RuntimeError(f"the server did not start: {server.stderr.read()}")
            served = evaluate("local-completions", f"model=m,base_url=http://127.0.0.1:{port}/v1/completions,"
                                                   "num_concurrent=1,max_retries=1", tmp)
        finally:
            server.terminate()
            server.wait(timeout=60)
        local = evaluate("hf", f"pretrained={hf},dtype=float32", tmp)

    def per_choice(samples):
        by_doc = {s["doc_id"]: s for s in samples}
        return [resp[0] for d in sorted(by_doc) for resp in by_doc[d]["resps"]]

    a, b = per_choice(served[1]), per_choice(local[1])
    assert len(a) == len(b) == 4 * len(docs()), (len(a), len(b))
    diff = max(abs(float(x[0]) - float(y[0])) for x, y in zip(a, b))
    greedy = sum(bool(x[1]) != bool(y[1]) for x, y in zip(a, b))
    import lm_eval
    import transformers

    from machine import base_info, write_results

    figures = {**base_info(), "lm_eval": lm_eval.__version__, "transformers": transformers.__version__,
               "model": args.run or "random-weight tiny", "choices": len(a),
               "acc_fivefold_serve": served[0]["acc,none"], "acc_hf": local[0]["acc,none"],
               "max_abs_loglikelihood_diff": diff, "is_greedy_differences": greedy,
               "seconds_fivefold_serve": round(served[2], 2), "seconds_hf": round(local[2], 2)}
    print(f"{len(a)} choices of {len(docs())} questions: accuracy {figures['acc_fivefold_serve']:.4f} through "
          f"fivefold serve, {figures['acc_hf']:.4f} through transformers; largest log-likelihood difference "
          f"{diff:.2e} nats, is-greedy flags differing: {greedy}; {served[2]:.1f} s vs {local[2]:.1f} s")
    if args.out:
        write_results(args.out, figures)
    ok = figures["acc_fivefold_serve"] == figures["acc_hf"] and diff < 1e-3 and not math.isnan(diff)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
