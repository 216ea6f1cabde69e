"""Where a result came from: the source tree a run started from, and the config it ran.

Two records, both written before any work starts:

- `source_state()`: the git commit of the checkout, whether code differs from it (tracked
  changes and untracked files outside docs/; docs do not change results), a hash of that
  difference and the difference itself, so that a result run from a dirty tree can be
  reproduced from its commit plus its stored diff.
- The launch history of a workdir (`launches.jsonl`, one line per launch: time, argv, the
  source state, the resolved config and its fingerprint). `check_resume` compares a
  relaunch's config with the launch that wrote the workdir's checkpoints and refuses to
  resume under a config that differs in a field that can change results, unless the
  launch names that field in `config.resume.allow_changes` (more steps, another
  evaluation cadence, ...).

Fields that never change what a run computes (`RESULT_NEUTRAL`: where it writes, whether it
resumes, where its metrics go) are left out of the fingerprint; every other field is in it,
evaluation and checkpoint cadence too (async rollouts drain at those boundaries).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys

import ml_collections

LAUNCHES_FILE = "launches.jsonl"

# Dotted config paths (a path covers its sub-fields) that cannot change a run's numbers.
RESULT_NEUTRAL = ("workdir", "resume", "metrics", "distributed")

# Paths whose changes are not code: a tree that differs from its commit only there still
# runs the commit's code.
_NOT_CODE = ("docs",)


def _git(args: list[str], cwd: str | None) -> str:
  return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                        cwd=cwd).stdout


def source_state(cwd: str | None = None) -> dict:
  """The checkout's commit and its uncommitted code: {"commit", "dirty", "diff_sha256",
  "diff"}. `diff` is `git diff HEAD` of the tracked files outside docs/ plus each untracked,
  non-ignored file outside docs/ as a new-file diff; empty (and `dirty` False) for a clean
  tree. Outside a git checkout: commit "unknown", dirty None."""
  try:
    commit = _git(["rev-parse", "HEAD"], cwd).strip()
    excludes = [f":(exclude){path}" for path in _NOT_CODE]
    diff = _git(["diff", "HEAD", "--binary", "--", ".", *excludes], cwd)
    untracked = _git(["ls-files", "--others", "--exclude-standard", "-z", "--", ".",
                      *excludes], cwd).split("\0")
    for path in filter(None, untracked):
      # `git diff --no-index` exits 1 when the files differ, as a new file always does.
      diff += subprocess.run(["git", "diff", "--no-index", "--binary", "--", os.devnull, path],
                             capture_output=True, text=True, cwd=cwd).stdout
  except (OSError, subprocess.CalledProcessError):
    return {"commit": "unknown", "dirty": None, "diff_sha256": "", "diff": ""}
  return {"commit": commit, "dirty": bool(diff),
          "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else "",
          "diff": diff}


def commit_label(state: dict) -> str:
  """"<commit>", or "<commit>-dirty-<first 12 hex digits of the diff's hash>"."""
  if not state["dirty"]:
    return state["commit"]
  return f"{state['commit']}-dirty-{state['diff_sha256'][:12]}"


def flatten(config: ml_collections.ConfigDict | dict, prefix: str = "") -> dict:
  """{dotted path: value} of every leaf field, tuples as lists (as JSON holds them)."""
  items = config.items() if hasattr(config, "items") else config
  flat = {}
  for key, value in items:
    path = f"{prefix}{key}"
    if isinstance(value, (dict, ml_collections.ConfigDict)):
      flat.update(flatten(value, path + "."))
    else:
      flat[path] = list(value) if isinstance(value, tuple) else value
  return flat


def _covered(path: str, prefixes) -> bool:
  return any(path == p or path.startswith(p + ".") for p in prefixes)


def result_fields(config) -> dict:
  """The fields of `config` that can change what a run computes: every leaf but
  RESULT_NEUTRAL's, JSON-normalised."""
  flat = flatten(json.loads(config.to_json_best_effort()) if hasattr(
      config, "to_json_best_effort") else config)
  return {path: value for path, value in sorted(flat.items())
          if not _covered(path, RESULT_NEUTRAL)}


def fingerprint(config) -> str:
  """A hash of `result_fields(config)`: two launches with the same fingerprint compute the
  same run."""
  text = json.dumps(result_fields(config), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def changed_fields(before: dict, after: dict) -> dict[str, tuple]:
  """{path: (before's value, after's value)} for each field both sides have whose values
  differ. A field only one side has is a field the code added or removed between the two
  launches (`launch_record` lists them as not compared): its default is taken to be what
  the older code did, so it alone does not refuse a resume."""
  return {path: (before[path], after[path]) for path in sorted(set(before) & set(after))
          if before[path] != after[path]}


def allowed_changes(config) -> tuple[str, ...]:
  """The dotted paths of config.resume.allow_changes ("rl.steps,eval.every"), each checked
  to name a field of the config (or a section of fields)."""
  text = config.resume.allow_changes
  names = tuple(name.strip().removeprefix("config.") for name in text.split(",")
                if name.strip())
  fields = flatten(json.loads(config.to_json_best_effort()))
  for name in names:
    if not any(_covered(path, (name,)) for path in fields):
      raise ValueError(f"config.resume.allow_changes names {name!r}, which is no field of the "
                       "config; name dotted fields such as 'rl.steps,eval.every'.")
  return names


def read_launches(workdir: str) -> list[dict]:
  """The launches recorded in `workdir`, oldest first (none for a new workdir)."""
  path = os.path.join(workdir, LAUNCHES_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def check_resume(config, launches: list[dict]) -> dict[str, tuple]:
  """Raises ValueError when `config` would resume the checkpoints the latest of
  `launches` wrote under a config that differs in a field that changes results and that
  config.resume.allow_changes does not name; returns the changes it allows (empty when
  nothing changed, or when no launch was recorded: a workdir from before launch records)."""
  if not launches:
    return {}
  previous = launches[-1]
  changes = changed_fields(previous["result_fields"], result_fields(config))
  allowed = allowed_changes(config)
  refused = {path: values for path, values in changes.items() if not _covered(path, allowed)}
  if refused:
    lines = "\n".join(f"  config.{path}: {before!r} -> {after!r}"
                      for path, (before, after) in refused.items())
    raise ValueError(
        f"{config.workdir} holds checkpoints of a run launched "
        f"{previous['time']} with another config; resuming would mix two runs. Fields that "
        f"differ:\n{lines}\nUse a new config.workdir, or relaunch with the recorded values, "
        "or, if the change is meant (more steps, another evaluation cadence), name the "
        f"fields: --config.resume.allow_changes={','.join(refused)}")
  return changes


def launch_record(config, source: dict, allowed: dict[str, tuple],
                  previous: dict | None = None) -> dict:
  """One line of launches.jsonl: when, the command line, the source tree (commit and the
  hash of its uncommitted code), the fingerprint and result fields, the changes this launch
  was allowed to make, the fields that `previous` (the launch it resumes) lacks or has
  beyond this config's (not compared: the code changed), and the whole resolved config."""
  fields = result_fields(config)
  not_compared = ([] if previous is None else
                  sorted(set(fields) ^ set(previous["result_fields"])))
  return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "argv": list(sys.argv), "commit": commit_label(source),
          "fingerprint": fingerprint(config), "allowed_changes": {
              path: list(values) for path, values in allowed.items()},
          "fields_not_compared": not_compared, "result_fields": fields,
          "config": json.loads(config.to_json_best_effort())}


def append_launch(workdir: str, record: dict) -> None:
  """Appends `record` to the workdir's launches.jsonl."""
  with open(os.path.join(workdir, LAUNCHES_FILE), "a") as f:
    f.write(json.dumps(record, sort_keys=True) + "\n")
