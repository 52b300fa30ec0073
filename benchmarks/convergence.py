r"""Convergence of CSC on real data: test accuracy and bytes per step vs dense all-reduce.

  PYTHONPATH=. python benchmarks/convergence.py [--epochs 10] [--densities 0.1,0.01,0.001,auto]
      [--selections per_pack,global] [--bytes_per_pack 1] [--no_baselines]

Trains the digits CNN (models.networks.digits_cnn, 0.54M parameters) on
scikit-learn's handwritten digits (1437 train / 360 test images) with
`python -m models.train` on 2 local workers (gf-tf-run, 127.0.0.1), the same
epochs, seeds, batch size and learning-rate schedule for every row:
  dense FP32  TF's own float32 all-reduce, SGD with momentum 0.9
  dense FP16  GradientFlowAllReduce(compression="fp16"), SGD with momentum 0.9
  CSC d       FP16 wire + ChunkSparsity(density=d, momentum=0.9 correction) after
              --warmup_steps dense steps, plain SGD (momentum lives in CSC);
              d = auto: ChunkSparsity(density="auto"), the density chosen each step
              from the measured compute and all-reduce time (the density column
              shows its mean over the last epoch)
  CSC d cold  the same without warm-up (sparse from the first step), to show
              what the warm-up contributes
  CSC d cold m0  plain error feedback and plain SGD (no momentum anywhere), no warm-up
  CSC d global   the CSC d row with ChunkSparsity(selection="global") (one top-K over
              all packs; rows per --selections; with one pack, the default
              --bytes_per_pack for this model, both selections are the same)
and prints one row per run: test accuracy (whole test set), its difference to
dense FP32 in points, bytes sent per step and replica after warm-up, and the
compression ratio against float32 dense bytes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def row_name(density: str, suffix: str = "") -> str:
    """'CSC 0.01', 'CSC auto', ... for a --densities entry."""
    label = "auto" if density.strip().lower() == "auto" else f"{float(density):g}"
    return f"CSC {label}{suffix}"


def run(name, flags, args, workdir):
    model_dir = os.path.join(workdir, name.replace(" ", "_"))
    cmd = [sys.executable, "-m", "gf_tf.launch", "-n", str(args.workers), "--",
           sys.executable, "-m", "models.train", "--model_dir", model_dir,
           "--epochs", str(args.epochs), "--seed", str(args.seed),
           "--batch_size", str(args.batch_size), "--learning_rate", str(args.learning_rate),
           "--warmup_steps", str(args.warmup_steps), "--chunk_size", str(args.chunk_size),
           *([] if args.bytes_per_pack is None else ["--bytes_per_pack", str(args.bytes_per_pack)]),
           "--collective_timeout", "120", *flags]  # later flags win (absl)
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")
    with open(os.path.join(model_dir, "results.json")) as f:
        result = json.load(f)
    result["seconds"] = seconds
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--densities", default="0.1,0.01,0.001")
    parser.add_argument("--cold_densities", default="0.01",
                        help="densities also run without warm-up ('' = none)")
    parser.add_argument("--warmup_steps", type=int, default=50)
    parser.add_argument("--selections", default="per_pack",
                        help="CSC top-k per pack and/or over the whole model: comma-separated "
                             "per_pack, global (one row each per density)")
    parser.add_argument("--bytes_per_pack", type=int, default=None,
                        help="lazy all-reduce threshold in wire bytes (models.train's default if "
                             "unset: one pack for the digits CNN; 1: one pack per tensor)")
    parser.add_argument("--no_baselines", action="store_true",
                        help="skip the dense FP32 / FP16 rows ('vs FP32' is then against the first row)")
    parser.add_argument("--chunk_size", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = parser.parse_args()

    runs = [] if args.no_baselines else [
        ("dense FP32", ["--compression", "none", "--density", "1"]),
        ("dense FP16", ["--compression", "fp16", "--density", "1"])]
    selections = list(filter(None, args.selections.split(",")))
    for d in filter(None, args.densities.split(",")):
        for s in selections:
            runs.append((row_name(d, "" if s == "per_pack" else f" {s}"),
                         ["--compression", "fp16", "--density", d, "--selection", s]))
    for d in filter(None, args.cold_densities.split(",")):
        runs.append((row_name(d, " cold"), ["--compression", "fp16", "--density", d,
                                                 "--warmup_steps", "0"]))
        runs.append((row_name(d, " cold m0"), ["--compression", "fp16", "--density", d,
                                                    "--warmup_steps", "0", "--momentum", "0"]))

    print(f"digits_cnn on sklearn digits, {args.workers} workers, {args.epochs} epochs, "
          f"batch {args.batch_size}, lr {args.learning_rate} cosine, seed {args.seed}; "
          f"CSC: chunk_size {args.chunk_size}, {args.warmup_steps} dense warm-up steps, "
          f"momentum correction 0.9; bytes_per_pack "
          f"{'default' if args.bytes_per_pack is None else args.bytes_per_pack}", flush=True)
    header = (f"{'run':<20} {'test acc':>8} {'vs FP32':>8} {'bytes/step':>12} "
              f"{'ratio':>7} {'density':>8} {'mean bytes/step':>16} {'seconds':>8}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gf_tf_convergence_") as workdir:
        for name, flags in runs:
            r = run(name, flags, args, workdir)
            rows.append((name, r))
            print(f"  done: {name}: accuracy {r['test_accuracy']:.4f}", flush=True)
    base = rows[0][1]["test_accuracy"]
    print("\n" + header)
    for name, r in rows:
        after = r["last_epoch_sent_bytes_per_step"]
        print(f"{name:<20} {100 * r['test_accuracy']:>7.2f}% {100 * (r['test_accuracy'] - base):>+7.2f} "
              f"{after:>12,.0f} {r['dense_bytes_per_step'] / after:>6.1f}x "
              f"{r.get('last_epoch_density', 1.0):>8.4g} "
              f"{r['sent_bytes_per_step']:>16,.0f} {r['seconds']:>8.0f}")
    print("bytes/step, density: per replica and step in the last epoch (after warm-up); "
          "mean bytes/step: over all steps, warm-up included; ratio: float32 dense bytes / bytes/step; "
          "cold: no warm-up; m0: no momentum anywhere (plain SGD, plain error feedback)")


if __name__ == "__main__":
    main()
