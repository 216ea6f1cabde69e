"""A stand-in grid cell for tests/test_grid.py: a few resumable steps, then summary.json.

    python -m tests.grid_cell --steps=3 --scale=2 --config.seed=1 --config.workdir=DIR

Each run appends "start" to DIR/steps.log, then each step appends "step <i>" in one write:
the log is also the checkpoint, so a rerun after a kill continues after the last logged
step. The summary depends on the flags only, so an interrupted run and an uninterrupted one
write the same. With --hold_seed=S --hold_file=F, the cell of seed S stops after its first
step until F exists (the test kills the grid there).
"""

import argparse
import json
import os
import sys
import time


def steps_done(log_path: str) -> int:
  if not os.path.exists(log_path):
    return 0
  with open(log_path) as f:
    return sum(line.startswith("step ") for line in f)


def main(argv) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--scale", type=float, required=True)
  parser.add_argument("--hold_seed", type=int, default=-1)
  parser.add_argument("--hold_file", default="")
  parser.add_argument("--config.seed", dest="seed", type=int, required=True)
  parser.add_argument("--config.workdir", dest="workdir", required=True)
  args = parser.parse_args(argv)
  os.makedirs(args.workdir, exist_ok=True)
  log_path = os.path.join(args.workdir, "steps.log")
  with open(log_path, "a") as log:
    log.write("start\n")
  for step in range(steps_done(log_path), args.steps):
    with open(log_path, "a") as log:
      log.write(f"step {step}\n")
    while args.seed == args.hold_seed and not os.path.exists(args.hold_file):
      time.sleep(0.01)
  with open(os.path.join(args.workdir, "summary.json"), "w") as f:
    json.dump({"score": args.scale * (args.seed + 1), "steps": args.steps,
               "label": f"seed {args.seed}"}, f)


if __name__ == "__main__":
  main(sys.argv[1:])
