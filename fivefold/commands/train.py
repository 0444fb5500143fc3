"""`fivefold train`, `compare-runs` and `plot`."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from pathlib import Path

from fivefold.commands.args import add_config_args, config_from_args, positive_int
from fivefold.errors import CheckpointSaveError
from fivefold.parallel.launch import check_launch, launch_workers
from fivefold.train.compare import compare_runs
from fivefold.train.plot import plot_run
from fivefold.train.run_lock import HELD_ENV, RunLock
from fivefold.train.trainer import Trainer


COMMAND_ENV = "FIVEFOLD_COMMAND"  # the launcher's command line, as workers do not see --nproc


def register(sub) -> None:
    train = sub.add_parser("train", help="train a model (default: the demo model on the embedded corpus)")
    add_config_args(train)
    train.add_argument("--out", help="run directory (overrides train.out_dir)")
    train.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                       help="launch N processes on this machine through torch.distributed.run (torchrun); "
                            "without an explicit parallel layout they are data parallel (parallel.dp=N)")
    group = train.add_mutually_exclusive_group()
    group.add_argument("--no-resume", dest="resume", action="store_false",
                       help="refuse to continue an existing run in the run directory")
    group.add_argument("--overwrite", action="store_true",
                       help="delete the run directory's checkpoints and metrics and start over")
    train.add_argument("--no-fallback", dest="fallback", action="store_false",
                       help="refuse to resume when the newest checkpoint is damaged, instead of resuming from "
                            "the newest intact one (train.checkpoint_fallback=false)")
    train.set_defaults(func=run_train)

    cmp = sub.add_parser("compare-runs", help="compare two runs' per-step losses (parity check)")
    cmp.add_argument("run_a", help="run directory, metrics.jsonl, or a golden .json")
    cmp.add_argument("run_b")
    cmp.add_argument("--key", default="loss", help="metric to compare (default: loss)")
    cmp.add_argument("--rtol", type=float, default=1e-5)
    cmp.add_argument("--atol", type=float, default=0.0)
    cmp.set_defaults(func=run_compare)

    plot = sub.add_parser("plot", help="draw a run's metrics: loss, lr, global batch and gradient noise scale "
                                       "over tokens seen")
    plot.add_argument("run_dir", help="run directory (holding metrics.jsonl)")
    plot.add_argument("--png", help="image to write (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=run_plot)


def run_train(args) -> int:
    cfg = config_from_args(args)
    if args.out:
        cfg.train.out_dir = args.out
    if not args.fallback:
        cfg.train.checkpoint_fallback = False
    out = Path(cfg.train.out_dir)
    worker = "LOCAL_RANK" in os.environ
    if args.nproc > 1 and not worker:
        check_launch(cfg, args.nproc)  # before the run directory is touched
    # The launching process holds the run directory for the whole job: the single process, the
    # `--nproc` launcher (its workers inherit HELD_ENV), or rank 0 of an external torchrun.
    lock = contextlib.nullcontext()
    if not worker or (os.environ.get("RANK") == "0" and HELD_ENV not in os.environ):
        lock = RunLock(out)
    with lock:
        if args.nproc > 1 and not worker:
            os.environ[HELD_ENV] = str(os.getpid())
            os.environ[COMMAND_ENV] = shlex.join(["fivefold", *sys.argv[1:]])  # for the workers' resume hint
            return launch_workers(cfg, args.nproc, sys.argv[1:], "train")
        return _train(cfg, args, out)


def _train(cfg, args, out: Path) -> int:
    is_main = os.environ.get("RANK", "0") == "0"
    has_run = (out / "checkpoints" / "latest").is_file() and not args.overwrite
    if args.overwrite and out.exists() and is_main:
        for name in ("checkpoints", "metrics.jsonl", "tensorboard"):
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        has_run = False
    if has_run and not args.resume:
        print(f"fivefold train: error: {out} already holds a run; drop --no-resume to continue it, "
              f"or pass --overwrite to start over", file=sys.stderr)
        return 2
    trainer = Trainer(cfg, resume=has_run)
    say = print if trainer.mesh.is_main else (lambda *a, **k: None)
    fused = [name for name, on in zip(("q/k/v", "gate/up"), cfg.fused_projections(trainer.device.type)) if on]
    say(f"model: {trainer.num_params:,} parameters | global batch {cfg.global_batch_tokens:,} tokens "
        f"({cfg.train.micro_batch_size} x {cfg.train.grad_accum} x dp {cfg.parallel.dp} x {cfg.train.seq_len}) | "
        f"{cfg.train.precision} | recompute={cfg.train.recompute} | zero={cfg.parallel.zero} | tp={cfg.parallel.tp}"
        f"{'+sp' if cfg.parallel.sequence_parallel else ''} | "
        + (f"fused {', '.join(fused)} | " if fused else "") +
        f"device {trainer.device} | {trainer.peaks.describe()}")
    if trainer.step >= cfg.train.steps:
        say(f"already at step {trainer.step} of train.steps={cfg.train.steps}; nothing to train "
            f"(raise train.steps or pass --overwrite)")
        return 0
    trainer.fit()
    if trainer.interrupted:
        import signal

        name = signal.Signals(trainer.interrupted).name
        saved = (f"saved {trainer.checkpoint_root / f'step_{trainer.step:08d}'}" if trainer.save_error is None
                 else f"the save failed ({trainer.save_error})")
        command = os.environ.get(COMMAND_ENV) or shlex.join(["fivefold", *sys.argv[1:]])
        say(f"stopped by {name} after step {trainer.step} of {cfg.train.steps}; {saved}. Resume with the same "
            f"command: {command}", file=sys.stderr)
        return 128 + trainer.interrupted
    if trainer.save_error is not None:
        raise CheckpointSaveError(f"{trainer.save_error}. Training reached step {trainer.step}, but its final "
                                  f"checkpoint is not on disk; free space and run the same command again")
    val_loss = trainer.evaluate()
    baseline = trainer.unigram_loss()
    say(f"done: step {trainer.step}, validation loss {val_loss:.4f} (unigram baseline {baseline:.4f}); "
        f"checkpoint in {trainer.checkpoint_root / 'latest'}; metrics in {out / 'metrics.jsonl'}")
    return 0


def run_compare(args) -> int:
    result = compare_runs(args.run_a, args.run_b, args.key, args.rtol, args.atol)
    print(result.summary())
    return 0 if result.ok else 1


def run_plot(args) -> int:
    print(f"wrote {plot_run(args.run_dir, args.png)}")
    return 0
