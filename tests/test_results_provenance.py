"""Every committed result names the source it ran, and that source is in this history.

Each JSON file under docs/results/ (a grid cell, a benchmark, an evaluation; the PEFT
adapter folders, which are weights, aside) records the commit it ran (a grid cell's and a
benchmark's top-level "commit"; each evaluation row's "provenance"), and that commit is an
ancestor of HEAD: a rewritten history, or a result whose work landed again as another
commit, is caught at the next run (such a result is rerun, or, where a rerun of part of it
reproduces it exactly, names that rerun under "reproduced"). An evaluation row also names its problems' seed, their
hash and its sampling seed, and one of a trained policy says how many of its problems the
runs it evaluates trained on (checked by experiments.eval, not assumed).
"""

import json
import pathlib
import re
import subprocess

import pytest

_REPO = pathlib.Path(__file__).resolve().parent.parent
_RESULTS = _REPO / "docs" / "results"
_LABEL = re.compile(r"^([0-9a-f]{40})(-dirty(-[0-9a-f]+)?)?$")
_EVALUATION_FIELDS = ("commit", "problem_seed", "problems", "problems_sha256",
                      "sampling_seed", "overlap_with_training")
# Results recorded before their scripts named a commit, or at commits lost from the history,
# whose reruns are under way (each entry says which). A listed file that records its
# provenance now fails the test until it leaves this list, so the list only shrinks.
PENDING_RERUN = {
    **{f"docs/results/b9/fresh/{name}.json": "the fresh evaluation, rerun at a landed commit"
       for name in ("arbor_s0", "arbor_s1", "arbor_s2")},
    **{f"docs/results/b9/headroom/{name}.json": "the headroom table, rerun at a landed commit"
       for name in ("basic_arithmetic_t0.7", "basic_arithmetic_t1", "chain_sum_t1",
                    "gsm_symbolic_t1", "leg_counting_t1")},
    "docs/results/b9/trl_parity_lora.json": "one update against TRL's, rerun",
    "docs/results/b9/trl_s0.json": "TRL's run (commit 40e8e51 lost), rerun",
    "docs/results/bench_nat/bench_train_nat.json": "the NAT step benchmark, rerun on an idle "
                                                   "machine",
    "docs/results/bench_low_precision/profile_decode.json": "the decode profile, rerun on an "
                                                            "idle machine",
}


def _git(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True,
                        check=False)


def _history_available() -> str:
  """'' when this checkout has its full history, else why the test cannot run."""
  try:
    inside = _git("rev-parse", "--is-inside-work-tree")
  except OSError:
    return "git is not installed"
  if inside.returncode or inside.stdout.strip() != "true":
    return "not a git checkout (no history to check the results' commits against)"
  if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
    return "a shallow clone: older commits are absent (git fetch --unshallow)"
  return ""


def result_files() -> list[pathlib.Path]:
  return sorted(p for p in _RESULTS.rglob("*.json") if "adapters" not in p.parts)


def commit_labels(result) -> list[str]:
  """The commit labels a result records: its top-level "commit", or each evaluation row's
  provenance "commit". A run whose own commit was lost from the history (its work landed
  again as another commit) names, under "reproduced", the commit and the file of a rerun
  that reproduced its result: that commit is the one checked."""
  if isinstance(result, dict):
    if "reproduced" in result:
      return [result["reproduced"].get("commit")]
    return [result["commit"]] if "commit" in result else []
  return [row.get("provenance", {}).get("commit") for row in result
          if isinstance(row, dict)]


def evaluation_problems(path: pathlib.Path, result) -> list[str]:
  """What an evaluation row (experiments.eval's eval.json) lacks of its provenance."""
  if not isinstance(result, list):
    return []
  problems = []
  for row in result:
    record = row.get("provenance") or {}
    missing = [f for f in _EVALUATION_FIELDS if f not in record]
    if missing:
      problems.append(f"{path.relative_to(_REPO)} step {row.get('step')}: no {missing}")
    elif row.get("step") not in (0, "initial") and record["overlap_with_training"] is None:
      problems.append(f"{path.relative_to(_REPO)} step {row.get('step')}: a trained policy's "
                      "evaluation without its overlap with the training prompts "
                      "(experiments.eval --trained_seeds)")
  return problems


def reproduction_problems(path: pathlib.Path, result) -> list[str]:
  """A "reproduced" record must name a committed file that ran at its commit."""
  if not isinstance(result, dict) or "reproduced" not in result:
    return []
  record = result["reproduced"]
  rerun = _REPO / record.get("file", "")
  if not record.get("file") or not rerun.is_file():
    return [f"{path.relative_to(_REPO)}: its reproduction {record.get('file')!r} is not a file"]
  if record.get("commit") not in commit_labels(json.loads(rerun.read_text())):
    return [f"{path.relative_to(_REPO)}: {record['file']} did not run at {record.get('commit')}"]
  return []


def file_problems(path: pathlib.Path, result, checked: dict) -> list[str]:
  """What a result file lacks of its provenance (`checked` caches commit -> ancestor)."""
  problems = []
  labels = commit_labels(result)
  if not labels or not all(labels):
    problems.append(f"{path.relative_to(_REPO)}: records no commit")
  for label in filter(None, labels):
    match = _LABEL.match(label)
    if match is None:
      problems.append(f"{path.relative_to(_REPO)}: commit {label!r} is not a commit label")
      continue
    commit = match.group(1)
    if commit not in checked:
      checked[commit] = _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0
    if not checked[commit]:
      problems.append(f"{path.relative_to(_REPO)}: commit {commit[:12]} is not an ancestor "
                      "of HEAD (absent, or on a history that was rewritten): rerun it")
  return problems + evaluation_problems(path, result) + reproduction_problems(path, result)


def test_every_result_records_a_commit_that_is_an_ancestor_of_head():
  why = _history_available()
  if why:
    pytest.skip(f"cannot check the results' commits: {why}")
  problems = [f"{name}: in PENDING_RERUN but not a result file" for name in PENDING_RERUN
              if not (_REPO / name).is_file()]
  checked = {}
  for path in result_files():
    found = file_problems(path, json.loads(path.read_text()), checked)
    if str(path.relative_to(_REPO)) not in PENDING_RERUN:
      problems += found
    elif not found:
      problems.append(f"{path.relative_to(_REPO)} records its provenance now: take it out "
                      "of PENDING_RERUN")
  assert not problems, "\n".join(problems)
  assert checked  # the results do record commits


def test_a_result_from_another_history_is_caught(tmp_path):
  """A label whose commit this history lacks, and an evaluation row without provenance,
  are reported."""
  why = _history_available()
  if why:
    pytest.skip(f"cannot check the results' commits: {why}")
  absent = "0123456789abcdef0123456789abcdef01234567"
  assert _git("merge-base", "--is-ancestor", absent, "HEAD").returncode != 0
  head = _git("rev-parse", "HEAD").stdout.strip()
  assert _git("merge-base", "--is-ancestor", head, "HEAD").returncode == 0
  assert commit_labels({"commit": f"{head}-dirty-abc123"}) == [f"{head}-dirty-abc123"]
  assert _LABEL.match(f"{head}-dirty-abc123").group(1) == head
  path = _RESULTS / "example.json"
  rows = [{"step": "adapter", "greedy_accuracy": 0.5}]
  assert evaluation_problems(path, rows) == [
      f"docs/results/example.json step adapter: no {list(_EVALUATION_FIELDS)}"]
  rows[0]["provenance"] = dict.fromkeys(_EVALUATION_FIELDS)
  assert "without its overlap" in evaluation_problems(path, rows)[0]
