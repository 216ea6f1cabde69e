"""experiments/grid.py: cells run as subprocesses N at a time; a grid killed midway and rerun
runs no finished cell again, resumes the interrupted one in its workdir and ends with the
results of an uninterrupted run; job-array lines, failed cells and the table of means.

The cells are tests/grid_cell.py, a stand-in that takes a fraction of a second."""

import ast
import json
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import time

import pytest

from experiments import grid
from experiments import provenance
from experiments.grids import pages
from rl import wiring

_REPO = pathlib.Path(__file__).resolve().parent.parent
_ENV = dict(os.environ, PYTHONPATH=str(_REPO))
NAMES = ("a_s0", "a_s1", "b_s0", "b_s1")


def write_spec(folder, entries) -> pathlib.Path:
  path = folder / "grid.json"
  path.write_text(json.dumps({"cells": entries}))
  return path


def stand_in(name, scale, hold_file, **seed):
  """A spec entry of tests/grid_cell.py cells; seed 1 holds after its first step until
  `hold_file` exists."""
  return {"name": name, "module": "tests.grid_cell", **(seed or {"seeds": [0, 1]}),
          "flags": {"steps": 3, "scale": scale, "hold_seed": 1, "hold_file": str(hold_file)}}


def run_grid(spec, out, *extra, check=True) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.grid", f"--spec={spec}",
                         f"--out={out}", *extra], cwd=_REPO, env=_ENV, capture_output=True,
                        text=True, check=check, timeout=300)


def steps_log(out, name) -> list[str]:
  path = out / "runs" / name / "steps.log"
  return path.read_text().split("\n")[:-1] if path.exists() else []


def read(path):
  return json.loads(path.read_text())


def test_a_killed_grid_resumes_without_running_a_cell_twice(tmp_path):
  hold = tmp_path / "release"
  spec = write_spec(tmp_path, [stand_in("a", 1.0, hold), stand_in("b", 2.5, hold)])
  out = tmp_path / "out"
  process = subprocess.Popen([sys.executable, "-m", "experiments.grid", f"--spec={spec}",
                              f"--out={out}", "--workers=1"], cwd=_REPO, env=_ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
  try:  # a_s0 finished; a_s1 is held after its first step
    deadline = time.time() + 120
    while not ((out / "a_s0.json").exists() and "step 0" in steps_log(out, "a_s1")):
      assert process.poll() is None and time.time() < deadline, "the grid did not get there"
      time.sleep(0.02)
  finally:
    os.killpg(process.pid, signal.SIGKILL)  # the grid and its running cell
    process.wait()
  assert not (out / "a_s1.json").exists()

  hold.touch()
  run_grid(spec, out, "--workers=1")
  full = ["start", "step 0", "step 1", "step 2"]
  assert steps_log(out, "a_s0") == full  # finished before the kill: not run again
  assert steps_log(out, "a_s1") == ["start", "step 0", "start", "step 1", "step 2"]  # resumed
  assert steps_log(out, "b_s0") == full and steps_log(out, "b_s1") == full

  fresh = tmp_path / "fresh"
  run_grid(spec, fresh, "--workers=2")
  for name in NAMES:
    got, want = read(out / f"{name}.json"), read(fresh / f"{name}.json")
    assert got["command"][-1] == f"--config.workdir={out / 'runs' / name}"
    for result in (got, want):
      # The attempt's time and the machine's load then; the out folder.
      del result["wall_s"], result["load_average"], result["command"]
    assert got["machine"] == grid.machine() and got["machine"].endswith(
        f", {os.cpu_count()} cores")
    assert got == want
  table = (out / "results.md").read_text()
  assert table == (fresh / "results.md").read_text()
  assert "| scale=1.0 | 0, 1 | 1.5 ± 0.71 | 3 ± 0 |" in table  # score (seed + 1) * scale
  assert "| scale=2.5 | 0, 1 | 3.75 ± 1.8 | 3 ± 0 |" in table


def test_job_array_lines_failed_cells_and_the_plot(tmp_path):
  spec = write_spec(tmp_path, [
      stand_in("ok", 2.0, tmp_path, seed=0),
      {"name": "broken", "module": "tests.no_such_module", "seed": 0}])
  out = tmp_path / "out"
  lines = run_grid(spec, out, "--list").stdout.splitlines()
  assert [line.rsplit("--cell=", 1)[1] for line in lines] == ["ok", "broken"]
  subprocess.run(lines[0], shell=True, check=True, env=_ENV, timeout=300)  # one array task
  assert read(out / "ok.json")["summary"]["score"] == 2.0
  assert [line.rsplit("--cell=", 1)[1] for line in run_grid(spec, out, "--list").stdout
          .splitlines()] == ["broken"]

  failed = run_grid(spec, out, check=False)
  assert failed.returncode == 1 and "broken" in failed.stderr
  assert not (out / "broken.json").exists()
  assert "No module named" in (out / "logs" / "broken.log").read_text()
  assert steps_log(out, "ok") == ["start", "step 0", "step 1", "step 2"]  # not rerun
  run_grid(spec, out, "--render", "--plot", "--metrics=score,steps")
  table = (out / "results.md").read_text()
  assert "1 of 2 cells finished" in table and "| tests.grid_cell | 0 | 2 | 3 |" in table
  assert (out / "results.png").stat().st_size > 0


def test_render_groups_seeds_and_labels_settings():
  spec = grid.parse_spec({"cells": [
      {"name": "x", "module": "m", "seeds": [0, 1, 2], "flags": {"lr": 1, "k": 0}},
      {"name": "y", "module": "m", "seeds": [0], "flags": {"k": 0, "lr": 2}}]})
  assert [c.name for c in spec.cells] == ["x_s0", "x_s1", "x_s2", "y_s0"]
  summaries = [{"acc": 0.5, "time_s": {"rl": 2.0}}, {"acc": 0.7, "time_s": {"rl": 4.0}},
               {"acc": 0.6, "time_s": {"rl": 6.0}}, {"acc": 0.9, "note": "n/a"}]
  results = [{"name": c.name, "module": c.module, "flags": dict(c.flags), "seed": c.seed,
              "summary": s} for c, s in zip(spec.cells, summaries)]
  assert grid.default_metrics(results) == ["acc"]
  table = grid.render_table(spec, results, ["acc", "time_s.rl"])
  assert "| lr=1 | 0, 1, 2 | 0.6 ± 0.1 | 4 ± 2 |" in table
  assert "| lr=2 | 0 | 0.9 | - |" in table


@pytest.mark.parametrize("entries,message", [
    ([{"name": "x", "module": "m", "seed": 0}, {"name": "x", "module": "m", "seed": 1}],
     "appears 2 times"),
    ([{"name": "x", "module": "m", "seed": 0, "seeds": [1]}], "exactly one of"),
    ([{"name": "x/y", "module": "m", "seed": 0}], "letters, digits"),
])
def test_bad_specs_are_refused(entries, message):
  with pytest.raises(ValueError, match=message):
    grid.parse_spec({"cells": entries})


def test_a_python_spec_custom_seed_and_workdir_flags_and_the_seed_placeholder(tmp_path):
  path = tmp_path / "grid_spec.py"
  path.write_text("SPEC = {'seed_flag': 'seed', 'workdir_flag': 'dir', 'cells': [\n"
                  "    {'name': f'lr{lr}', 'module': 'm', 'seed': 3, 'flags': {'lr': lr}}\n"
                  "    for lr in (1, 2)]}\n")
  spec = grid.load_spec(str(path))
  assert [c.name for c in spec.cells] == ["lr1", "lr2"]
  assert grid.command(spec.cells[1], spec, "out")[2:] == [
      "m", "--lr=2", "--seed=3", f"--dir={os.path.join('out', 'runs', 'lr2')}"]
  # A {seed} placeholder goes into each seed's command, and the seeds share one setting.
  spec = grid.parse_spec({"cells": [
      {"name": "rl", "module": "m", "seeds": [0, 2],
       "flags": {"config.warm_start.init_from": "runs/warm/warm_s{seed}", "lr": 1}}]})
  assert [grid.command(c, spec, "out")[3] for c in spec.cells] == [
      "--config.warm_start.init_from=runs/warm/warm_s0",
      "--config.warm_start.init_from=runs/warm/warm_s2"]
  results = [{"name": c.name, "module": c.module, "flags": dict(c.flags), "seed": c.seed,
              "summary": {"accuracy": float(c.seed)}} for c in spec.cells]
  labels, groups = grid.group_by_setting(results)
  assert len(groups) == 1 and [r["seed"] for r in groups[0]] == [0, 2]


def _git(*args, cwd):
  return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                        check=True, capture_output=True, text=True).stdout.strip()


def _committed_repo(path, files: dict[str, str]) -> str:
  """A git repository at `path` holding `files` ({relative path: text}) in one commit; its
  commit hash."""
  _git("init", "-q", cwd=path)
  for name, text in files.items():
    (path / name).parent.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(text)
  _git("add", ".", cwd=path)
  _git("commit", "-qm", "x", cwd=path)
  return _git("rev-parse", "HEAD", cwd=path)


def test_source_state_names_the_commit_and_hashes_uncommitted_code(tmp_path):
  assert provenance.source_state(str(tmp_path))["commit"] == "unknown"  # not a checkout
  head = _committed_repo(tmp_path, {"f.py": "a = 1\n", "docs/page.md": "x\n"})
  clean = provenance.source_state(str(tmp_path))
  assert clean == {"commit": head, "dirty": False, "diff_sha256": "", "diff": ""}
  assert provenance.commit_label(clean) == head
  (tmp_path / "docs" / "page.md").write_text("y\n")  # docs are not code
  assert not provenance.source_state(str(tmp_path))["dirty"]
  (tmp_path / "f.py").write_text("a = 2\n")
  edited = provenance.source_state(str(tmp_path))
  assert edited["dirty"] and "-a = 1\n+a = 2" in edited["diff"]
  assert provenance.commit_label(edited) == f"{head}-dirty-{edited['diff_sha256'][:12]}"
  (tmp_path / "new.py").write_text("b = 3\n")  # an untracked module is code too
  added = provenance.source_state(str(tmp_path))
  assert "+b = 3" in added["diff"] and added["diff_sha256"] != edited["diff_sha256"]
  # Applying the stored diff to the commit gives back the tree that ran.
  copy = tmp_path / "copy"
  _git("clone", "-q", str(tmp_path), str(copy), cwd=tmp_path)
  (copy / "run.diff").write_text(added["diff"])
  _git("apply", "run.diff", cwd=copy)
  assert (copy / "f.py").read_text() == "a = 2\n" and (copy / "new.py").read_text() == "b = 3\n"


def test_a_cell_records_the_commit_it_started_from_and_its_diff(tmp_path):
  """The source is read when a cell starts: a commit made while it runs is not its commit.
  A dirty tree's diff is stored beside the result; into a tracked results folder a dirty
  tree is refused unless --allow_dirty."""
  repo = tmp_path / "repo"
  repo.mkdir()
  first = _committed_repo(repo, {"code.py": "x = 1\n", "results/README": "committed results\n"})
  hold = tmp_path / "release"
  spec = write_spec(tmp_path, [stand_in("c", 1.0, hold, seed=1)])

  def start(out, *extra):
    return subprocess.Popen([sys.executable, "-m", "experiments.grid", f"--spec={spec}",
                             f"--out={out}", *extra], cwd=repo, env=_ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

  out = repo / "runs"  # untracked
  process = start(out)
  deadline = time.time() + 120
  while "step 0" not in steps_log(out, "c"):
    assert process.poll() is None and time.time() < deadline, process.communicate()
    time.sleep(0.02)
  (repo / "code.py").write_text("x = 2\n")
  _git("commit", "-qam", "two", cwd=repo)  # committed while the cell runs
  hold.touch()
  assert process.wait(timeout=120) == 0
  result = read(out / "c.json")
  assert result["commit"] == first and result["source"]["dirty"] is False
  assert not (out / "c.diff").exists()

  (repo / "code.py").write_text("x = 3\n")  # uncommitted code
  refused = start(repo / "results")
  _, stderr = refused.communicate(timeout=120)
  assert refused.returncode != 0 and "--allow_dirty" in stderr
  assert not (repo / "results" / "c.json").exists()
  allowed = start(repo / "results", "--allow_dirty")
  allowed.communicate(timeout=120)
  assert allowed.returncode == 0
  result = read(repo / "results" / "c.json")
  second = _git("rev-parse", "HEAD", cwd=repo)
  assert result["source"]["dirty"] and result["commit"].startswith(f"{second}-dirty-")
  assert "+x = 3" in (repo / "results" / "c.diff").read_text()


def test_a_changed_spec_is_refused_until_rerun_changed(tmp_path):
  """A finished cell whose spec flags changed is neither reused nor rendered as the new
  setting: the grid names it and the flag, and --rerun_changed runs it again."""
  hold = tmp_path / "release"
  hold.touch()
  out = tmp_path / "out"
  run_grid(write_spec(tmp_path, [stand_in("a", 1.0, hold, seed=0),
                                 stand_in("b", 1.0, hold, seed=0)]), out)
  spec = write_spec(tmp_path, [stand_in("a", 4.0, hold, seed=0),
                               stand_in("b", 1.0, hold, seed=0)])
  for extra in ((), ("--render",), ("--list",)):
    refused = run_grid(spec, out, *extra, check=False)
    assert refused.returncode != 0
    assert "a: --scale: '1.0' -> '4.0'" in refused.stderr, refused.stderr
    assert "b:" not in refused.stderr
  assert read(out / "a.json")["summary"]["score"] == 1.0
  rerun = run_grid(spec, out, "--rerun_changed")
  assert "Removed the results of changed cells: a" in rerun.stdout
  assert read(out / "a.json")["summary"]["score"] == 4.0
  assert steps_log(out, "a") == ["start", "step 0", "step 1", "step 2"]  # a fresh workdir
  assert steps_log(out, "b") == ["start", "step 0", "step 1", "step 2"]  # not rerun


def test_pages_refuse_seeds_of_one_setting_that_ran_different_flags():
  results = [{"name": f"grpo_s{seed}", "seed": seed, "module": "experiments.train",
              "flags": {"config.rl.learning_rate": lr}} for seed, lr in ((0, "1e-4"),
                                                                         (1, "1e-3"))]
  with pytest.raises(ValueError, match="grpo_s0 ran .*1e-4.* but grpo_s1 ran .*1e-3"):
    pages.by_setting(results)
  results[1]["flags"] = dict(results[0]["flags"])
  assert [r["seed"] for r in pages.by_setting(results)["grpo"]] == [0, 1]


def _b5_result(name, seed, curve, rl_step_means, minibatches=1):
  """A result file as experiments.grid writes it for a B5 cell (the fields the page reads)."""
  flags_ = {"config.loss.name": name.split("_k")[0]}
  if minibatches > 1:
    flags_["config.rl.num_minibatches"] = str(minibatches)
  steps = [900 + 10 * i for i in range(len(curve))]
  return {"name": f"{name}_s{seed}", "seed": seed, "module": "experiments.train",
          "flags": flags_, "commit": "abc", "load_average": [2.0, 2.0, 2.0],
          "summary": {"final_accuracy": curve[-1], "warm_start_accuracy": curve[0],
                      "accuracy_curve": [{"step": s, "event": "eval", "accuracy": a,
                                          "stderr": 0.01} for s, a in zip(steps, curve)],
                      "rl_step_means": rl_step_means}}


def test_b5_page_tabulates_final_accuracy_area_and_step_metrics(tmp_path):
  b5 = runpy.run_path(os.path.join(_REPO, "experiments", "grids", "b5_staleness.py"))
  results = [_b5_result("grpo_k0", 0, [0.3, 0.5, 0.7], {"clip_fraction": 0.1}),
             _b5_result("grpo_k0", 1, [0.3, 0.7, 0.9], {"clip_fraction": 0.3}),
             _b5_result("stages_grpo_S4", 0, [0.3, 0.6], {"grad_norm": 2.0}, minibatches=4)]
  # Updates 0, 10, 20: trapezoid (0.3 + 2 * 0.5 + 0.7) / 4 = 0.5 and 0.65 for seed 1.
  assert pages.area_under_curve(*pages.rl_curve(results[0])) == pytest.approx(0.5)
  assert pages.rl_curve(results[2])[0] == [0, 40]  # a stage step is 4 updates
  page = b5["render_page"](results, str(tmp_path / "b5.md"))
  assert "3 of 90 cells finished" in page
  cells = _row(page, "grpo_k0")
  assert cells[1] == "0,1" and cells[2] == "0.700, 0.900" and cells[3] == "-"
  assert cells[4] == "0.800 ± 0.141" and cells[6] == "0.575 ± 0.106"
  assert cells[7] == "0.200 ± 0.141"  # the clip fraction's mean over seeds
  assert any(line.startswith("| stages_grpo_S4 |") for line in page.splitlines())
  assert (tmp_path / "b5.png").exists()


def test_paired_difference_compares_seed_by_seed_over_shared_seeds():
  final = lambda r: r["summary"]["final_accuracy"]
  grpo = [_b5_result("grpo_k8", s, [0.3, a], {}) for s, a in [(0, 0.5), (1, 0.9), (2, 0.6)]]
  other = [_b5_result("vcpo_k8", s, [0.3, a], {}) for s, a in [(0, 0.6), (1, 0.8), (3, 0.1)]]
  # Seeds 0 and 1 only: +0.1 and -0.1 (seed 3 has no GRPO run to pair with).
  assert pages.paired_difference(other, grpo, final) == "0.000 ± 0.141 (1 up, 1 down)"
  assert pages.paired_difference(grpo, grpo, final) == "0.000 ± 0.000 (0 up, 0 down)"
  assert pages.paired_difference(other[2:], grpo, final) == "-"


def test_opd_page_measures_tokens_to_the_target_against_grpo(tmp_path):
  opd = runpy.run_path(os.path.join(_REPO, "experiments", "grids", "opd.py"))
  assert len(opd["SPEC"]["cells"]) == 36
  results = [
      _cell_result("grpo", 0, [0.3, 0.7, 0.85], [0, 20000, 40000], [0.0, 5.0, 10.0],
                   {"distill_reverse_kl": 0.0}),
      _cell_result("opd_reverse_kl", 0, [0.3, 0.82, 0.9], [0, 10000, 20000],
                   [0.0, 6.0, 12.0], {"distill_reverse_kl": 0.2})]
  page = opd["render_page"](results, str(tmp_path / "opd.md"))
  row = _row(page, "opd_reverse_kl")
  assert row[2] == "0.900" and row[4] == "0.050 (1 up, 0 down)"
  assert row[5] == "10k" and row[6] == "0.25"  # 10k tokens against GRPO's 40k
  assert (tmp_path / "opd.png").exists()


def test_page_keeps_hand_written_text_around_the_generated_part(tmp_path):
  spec_path = tmp_path / "spec.py"
  spec_path.write_text("SPEC = {'cells': [{'name': 'a', 'module': 'm', 'seed': 0}]}\n"
                       "def render_page(results, page):\n"
                       "  return f'{len(results)} results'\n")
  spec = grid.load_spec(str(spec_path))
  page = tmp_path / "page.md"
  page.write_text("# Title\n\nFindings written by hand.\n")
  grid.write_page(str(spec_path), spec, str(tmp_path / "out"), str(page))
  grid.write_page(str(spec_path), spec, str(tmp_path / "out"), str(page))  # idempotent
  text = page.read_text()
  assert text.startswith("# Title\n\nFindings written by hand.\n")
  assert text.count(grid.PAGE_BEGIN) == 1 and "0 results" in text
  page.write_text(text.replace("Findings", "New findings") + "\nA closing note.\n")
  grid.write_page(str(spec_path), spec, str(tmp_path / "out"), str(page))
  text = page.read_text()
  assert "New findings" in text and text.endswith("A closing note.\n")


def _cell_result(name, seed, curve, tokens, seconds, step_means, windows=None, **summary):
  """A result file as experiments.grid writes it for a launcher cell: held-out accuracy at
  evaluations 10 steps apart, the RL tokens sampled and RL seconds before each."""
  steps = [900 + 10 * i for i in range(len(curve))]
  return {"name": f"{name}_s{seed}", "seed": seed, "module": "experiments.train", "flags": {},
          "commit": "abc", "summary": {
              "final_accuracy": curve[-1], "warm_start_accuracy": curve[0],
              "final_accuracy_stderr": 0.02, "prompts_skipped": 0,
              "accuracy_curve": [{"step": s, "event": "eval", "accuracy": a, "stderr": 0.02,
                                  "sampled_tokens": t} for s, a, t in zip(steps, curve, tokens)],
              "time_rl_at_evals_s": seconds, "time_rl_s": seconds[-1],
              "tokens": {"sampled": tokens[-1]}, "time_s": {"rollout": seconds[-1] / 2},
              "rl_step_means": step_means,
              "rl_step_means_between_evals": windows or [{}] * len(curve), **summary}}


def test_pages_read_accuracy_against_tokens_and_seconds():
  result = _cell_result("a", 0, [0.3, 0.5, 0.7], [0, 1000, 2000], [0.0, 4.0, 9.0], {})
  assert pages.rl_curve(result, "tokens") == ([0.0, 1000.0, 2000.0], [0.3, 0.5, 0.7])
  assert pages.rl_curve(result, "seconds")[0] == [0.0, 4.0, 9.0]
  assert pages.first_reaching(*pages.rl_curve(result, "tokens"), 0.5) == 1000.0
  assert pages.first_reaching(*pages.rl_curve(result, "tokens"), 0.71) is None
  assert pages.mean_std([None, 0.5]) == "0.500"
  with pytest.raises(ValueError, match="Unknown x axis"):
    pages.rl_curve(result, "steps")


def _row(page: str, name: str) -> list[str]:
  row = next(line for line in page.splitlines() if line.startswith(f"| {name} |"))
  return [c.strip() for c in row.split("|")[1:-1]]


def test_b3_page_compares_trees_with_independent_sampling_per_seed(tmp_path):
  b3 = runpy.run_path(os.path.join(_REPO, "experiments", "grids", "b3_tree.py"))
  assert len(b3["SPEC"]["cells"]) == 12
  results = [
      _cell_result("independent", 0, [0.3, 0.6, 0.8], [0, 20000, 40000], [0.0, 10.0, 20.0],
                   {"decoded_tokens": 2000.0, "rollouts": 64.0}),
      _cell_result("entropy", 0, [0.3, 0.8, 0.8], [0, 12000, 24000], [0.0, 8.0, 16.0],
                   {"decoded_tokens_per_leaf": 18.75, "leaves": 52.0})]
  page = b3["render_page"](results, str(tmp_path / "b3.md"))
  independent, entropy = _row(page, "independent"), _row(page, "entropy")
  assert independent[3] == "8.0" and entropy[3] == "6.5"    # 64 and 52 rows of 8 prompts
  assert independent[4] == "31.2" and entropy[4] == "18.8"  # 2000 / 64 decoded per leaf
  assert entropy[5] == "0.60"                               # 18.75 / 31.25
  assert entropy[7] == "12k" and independent[7] == "40k"    # first eval reaching 0.8
  assert (tmp_path / "b3.png").exists()


def test_b4_page_counts_sequences_per_decode_step_and_seconds_to_sync(tmp_path):
  b4 = runpy.run_path(os.path.join(_REPO, "experiments", "grids", "b4_partial_async.py"))
  assert len(b4["SPEC"]["cells"]) == 15
  results = [
      _cell_result("sync", 1, [0.3, 0.6, 0.8], [0, 1, 2], [0.0, 50.0, 100.0],
                   {"rollouts": 64.0, "decode_steps": 100.0}),
      _cell_result("partial_kept_kv", 1, [0.3, 0.8, 0.8], [0, 1, 2], [0.0, 40.0, 80.0],
                   {"rollouts": 64.0, "decode_steps": 40.0, "staleness": 1.5})]
  page = b4["render_page"](results, str(tmp_path / "b4.md"))
  sync, partial = _row(page, "sync"), _row(page, "partial_kept_kv")
  assert sync[4] == "0.640" and partial[4] == "1.600" and partial[5] == "2.50"
  assert sync[8] == "100" and partial[8] == "40" and partial[9] == "1.50"
  assert partial[10] == "0.000 (0 up, 0 down)"  # final minus sync's, seed by seed
  # A partial-rollout run reports no `rollouts`: its trained tokens over their mean length.
  partial_only = _cell_result("partial_reprefill", 1, [0.3, 0.8], [0, 1], [0.0, 40.0],
                              {"trained_tokens": 2560.0, "completion_len": 40.0,
                               "decode_steps": 32.0})
  assert b4["sequences_per_decode_step"](partial_only) == 2.0


def test_b6_page_measures_tokens_to_half_of_uniforms_gain(tmp_path):
  b6 = runpy.run_path(os.path.join(_REPO, "experiments", "grids", "b6_selection.py"))
  assert len(b6["SPEC"]["cells"]) == 12
  assert {c["flags"]["config.task.train_pool"] for c in b6["SPEC"]["cells"]} == {256}
  windows = lambda shares: [{}] + [{"informative_groups": 1.0 - s} for s in shares]
  results = [
      _cell_result("uniform", 2, [0.3, 0.4, 0.55, 0.7], [0, 3000, 6000, 9000],
                   [0.0, 1.0, 2.0, 3.0], {}, windows([0.5, 0.6, 0.7])),
      _cell_result("greso", 2, [0.3, 0.5, 0.6, 0.7], [0, 2000, 4000, 6000],
                   [0.0, 1.0, 2.0, 3.0], {}, windows([0.5, 0.3, 0.2]), prompts_skipped=40)]
  assert b6["target"](results[0]) == pytest.approx(0.5)  # 0.3 + (0.7 - 0.3) / 2
  page = b6["render_page"](results, str(tmp_path / "b6.md"))
  uniform, greso = _row(page, "uniform"), _row(page, "greso")
  assert uniform[2] == "1/1" and uniform[3] == "6.0k" and greso[3] == "2.0k"
  assert greso[4] == "3.00x"                                   # 6000 / 2000 tokens
  assert greso[7] == "0.50 -> 0.20" and greso[8] == "40"
  assert (tmp_path / "b6_zero_variance.png").exists()


def test_speculative_page_compares_sampling_seconds_with_plain_decoding(tmp_path):
  spec = runpy.run_path(os.path.join(_REPO, "experiments", "grids", "speculative.py"))
  assert len(spec["SPEC"]["cells"]) == 18
  pool = spec["POOL"]
  results = [
      _cell_result("plain", 0, [0.3, 0.8], [0, 1], [0.0, 50.0], {"completion_len": 40.0}),
      _cell_result("lookup_k4", 0, [0.3, 0.82], [0, 1], [0.0, 40.0],
                   {"completion_len": 40.0, "spec_accepted": 50.0,
                    "spec_forwards_per_token": 0.4, "spec_drafted": 100.0,
                    "spec_drafted_prompt_lookup": 100.0, "spec_accepted_prompt_lookup": 50.0}),
      _cell_result(f"plain_pool{pool}", 0, [0.3, 0.7], [0, 1], [0.0, 50.0],
                   {"completion_len": 40.0}),
      _cell_result(f"history_k4_pool{pool}", 0, [0.3, 0.75], [0, 1], [0.0, 30.0],
                   {"completion_len": 40.0, "spec_accepted": 140.0,
                    "spec_forwards_per_token": 0.3, "spec_drafted": 200.0,
                    # the step mean of a ratio that is 0 where nothing was drafted: unused
                    "spec_acceptance_history": 0.5,
                    "spec_drafted_history": 150.0, "spec_accepted_history": 120.0,
                    "spec_drafted_prompt_lookup": 50.0, "spec_accepted_prompt_lookup": 20.0})]
  for result, seconds in zip(results, (0.30, 0.20, 0.40, 0.10)):
    result["summary"]["time_sample_median_s"] = seconds
  page = spec["render_page"](results, str(tmp_path / "spec.md"))
  plain, lookup = _row(page, "plain"), _row(page, "lookup_k4")
  assert plain[4] == "0.300" and lookup[4] == "0.200" and lookup[5] == "1.50"
  assert lookup[6] == "0.500" and lookup[8] == "0.400" and plain[8] == "1.000"
  assert lookup[7] == "prompt_lookup 0.500 (100% of drafts)" and plain[7] == "-"
  assert lookup[3] == "0.020 (1 up, 0 down)"
  # The pool cells pair with plain decoding on the same pool, not with `plain`.
  history = _row(page, f"history_k4_pool{pool}")
  assert history[5] == "4.00" and history[3] == "0.050 (1 up, 0 down)"
  assert history[7] == "history 0.800 (75% of drafts); prompt_lookup 0.400 (25% of drafts)"
  assert history[6] == "0.700"
  assert _row(page, f"plain_pool{pool}")[5] == "-"
  assert (tmp_path / "spec.png").exists()


def test_tools_page_reports_long_problems_paired_and_tool_use(tmp_path):
  spec = runpy.run_path(os.path.join(_REPO, "experiments", "grids", "tools.py"))
  assert [c["name"] for c in spec["SPEC"]["cells"]][:2] == ["grpo_s0", "tools_s0"]
  by_size = lambda warm, final: {"1": {"examples": 300, "warm_start": 0.5, "final": 0.9},
                                 "5": {"examples": 10, "warm_start": warm, "final": final},
                                 "9": {"examples": 30, "warm_start": warm / 2, "final": final / 2}}
  grpo = _cell_result("grpo", 0, [0.3, 0.8], [0, 1], [0.0, 50.0], {},
                      accuracy_by_size=by_size(0.2, 0.4))
  tools = _cell_result("tools", 0, [0.3, 0.9], [0, 1], [0.0, 80.0], {},
                       [{}, {"tool_calls_per_rollout": 1.5}, {"tool_calls_per_rollout": 4.0}],
                       accuracy_by_size=by_size(0.2, 0.8),
                       tools={"warm_start_tool_calls": 0.1, "final_tool_calls": 3.0,
                              "warm_start_accuracy_no_tools": 0.3,
                              "final_accuracy_no_tools": 0.5,
                              "accuracy_by_size_no_tools": by_size(0.0, 0.0)})
  tools["summary"]["accuracy_curve"].append(dict(tools["summary"]["accuracy_curve"][-1]))
  # k >= 5: (10 * 0.4 + 30 * 0.2) / 40 = 0.25 for GRPO, 0.5 with the tool.
  assert spec["long_accuracy"](by_size(0.2, 0.4), {"5": 10, "9": 30}) == pytest.approx(0.25)
  page = spec["render_page"]([grpo, tools], str(tmp_path / "tools.md"))
  row, base = _row(page, "tools"), _row(page, "grpo")
  # warm start k >= 5 with the tool: (10 * 0.2 + 30 * 0.1) / 40 = 0.125
  assert base[5] == "0.250" and row[5] == "0.500" and row[4] == "0.125"
  assert row[7] == "0.250 (1 up, 0 down)" and base[7] == "-"
  assert row[8] == "0.000" and row[9] == "0.10" and row[10] == "3.00"
  assert row[11] == "1.50" and row[12] == "4.00" and base[9] == "-"
  assert (tmp_path / "tools.png").exists()


@pytest.mark.parametrize("spec", ["b3_tree", "b4_partial_async", "b5_staleness", "b6_selection",
                                  "opd", "speculative", "tools", "warm_starts", "moe",
                                  "low_precision"])
def test_every_benchmark_cell_is_a_valid_launcher_config(spec):
  """Each cell's flags name real fields with accepted values on the default config (the
  shared warm start's folder aside: it exists only once warm_starts.py has run)."""
  from experiments.configs import default  # pylint: disable=import-outside-toplevel
  entries = runpy.run_path(os.path.join(_REPO, "experiments", "grids", f"{spec}.py"))["SPEC"]
  assert entries["cells"]
  for cell in entries["cells"]:
    config = default.get_config()
    for path, value in cell["flags"].items():
      if path == "config.warm_start.init_from":
        assert "{seed}" in value  # each seed starts from its own warm start
        continue
      *parents, leaf = path.removeprefix("config.").split(".")
      node = config
      for name in parents:
        node = node[name]
      assert leaf in node, (cell["name"], path)
      if isinstance(node[leaf], tuple) and isinstance(value, str):
        value = ast.literal_eval(value)  # as the --config flag parses a tuple
      node[leaf] = value
    wiring.validate(config)


def test_b9_page_gives_each_seed_its_gain_and_seconds_beside_trl_and_the_fresh_evaluation(
    tmp_path):
  b9 = runpy.run_path(os.path.join(_REPO, "experiments", "grids", "b9_real_model.py"))
  results = [_cell_result("arbor", seed, [0.1, 0.2, 0.3], [0, 10, 20], [0.0, 1.0, 2.0], {},
                          steps=30, time_s={"rollout": 300.0, "train": 600.0})
             for seed in (0, 1)]
  with open(tmp_path / "trl_s0.json", "w") as f:
    json.dump({"seed": 0, "curve": [{"step": 0, "accuracy": 0.1, "stderr": 0.02},
                                    {"step": 30, "accuracy": 0.25, "stderr": 0.02}],
               "step_s_median": 100.0, "generate_s_median": 40.0}, f)
  (tmp_path / "fresh").mkdir()
  row = {"examples": 200, "num_samples": 8, "temperature": 0.7, "greedy_accuracy": 0.28,
         "pass@1": 0.21, "pass@8": 0.5, "mixed": 0.4, "sampled_length": 40.0}
  with open(tmp_path / "fresh" / "arbor_s1.json", "w") as f:
    json.dump([row], f)
  with open(tmp_path / "fresh" / "arbor_s0.json", "w") as f:
    json.dump([dict(row, provenance={"commit": "7196baaf79d4", "overlap_with_training": {
        "1": 0, "0": 2}})], f)
  page = b9["render_page"](results, str(tmp_path / "real_model.md"), results_dir=str(tmp_path))
  # 0.1 -> 0.3: +20 points, 0.2 / (0.02 * sqrt 2) = 7.1 standard errors; 900 s over 30 steps.
  assert _row(page, "Arbor, seed 1")[4:] == ["+20.0", "7.1", "30 (10 + 20)"]
  assert _row(page, "TRL, seed 0")[3:] == ["+15.0", "5.3", "100 (40 + 60), median"]
  assert _row(page, "arbor_s1") == ["arbor_s1", "0.280", "0.210", "0.500", "0.400", "40",
                                     "awaiting rerun", "-"]  # from before provenance
  assert _row(page, "arbor_s0")[6:] == ["7196baa", "s0: 2, s1: 0"]
  assert "| base |" not in page  # no file for it: no row
  assert (tmp_path / "real_model.png").exists()


def test_low_precision_page_pairs_each_cell_with_float32_rollouts_and_gives_verdicts(
    tmp_path):
  spec = runpy.run_path(os.path.join(_REPO, "experiments", "grids", "low_precision.py"))
  means = {"rollout_train_mismatch_kl": 0.001, "rollout_train_mismatch_k1": -0.0005,
           "rollout_train_log_ratio_over_0p1": 0.02, "rollout_train_log_ratio_max": 0.5}
  results = [_cell_result("f32_none", 0, [0.3, 0.6], [0, 1], [0, 1], {}),
             _cell_result("f32_none", 1, [0.3, 0.8], [0, 1], [0, 1], {}),
             _cell_result("int4_tis", 0, [0.3, 0.5], [0, 1], [0, 1],
                          {**means, "is_truncated_fraction": 0.01}),
             _cell_result("int4_tis", 1, [0.3, 0.9], [0, 1], [0, 1],
                          {**means, "is_truncated_fraction": 0.03}),
             _cell_result("k8_sc", 0, [0.3, 0.7], [0, 1], [0, 1], {"sc_score_shift": 0.2})]
  page = spec["render_page"](results, str(tmp_path / "low_precision.md"))
  assert f"5 of {len(spec['SPEC']['cells'])} cells finished" in page
  row = _row(page, "int4_tis")
  # int4 finals (0.5, 0.9) minus float32's (0.6, 0.8), seed by seed: (-0.1, +0.1).
  assert row[2] == "0.700 ± 0.283" and row[3] == "0.000 ± 0.141 (1 up, 1 down)"
  assert row[4] == "0.00100000 ± 0.00000000" and row[6] == "0.0200 ± 0.0000"
  assert row[8] == "is_truncated_fraction: 0.0200 ± 0.0141"
  assert _row(page, "f32_none")[3] == "-"
  assert _row(page, "k8_sc")[8] == "sc_score_shift: 0.20000"
  assert (tmp_path / "low_precision.png").exists()
  # Recovery verdicts: paired t-tests, bounded by the evaluation's noise.
  recovery = spec["recovery"]
  cells = lambda name, finals: [_cell_result(name, s, [0.3, a], [0, 1], [0, 1], {})
                                for s, a in enumerate(finals)]
  f32 = cells("f32_none", (0.80, 0.85, 0.90))
  # d = -0.10, -0.11, -0.09: stderr 0.01 / sqrt(3) = 0.0058, t = 17.3 > t(0.975, 2) = 4.30.
  assert recovery(cells("int4_none", (0.70, 0.74, 0.81)), f32) == "below (-0.100 ± 0.006, 3 of 3 lower)"
  # d = +0.10, +0.11, +0.09 (the mirror image).
  assert recovery(cells("int4_tis", (0.90, 0.96, 0.99)), f32) == "above (+0.100 ± 0.006, 0 of 3 lower)"
  # d = -0.20, -0.05, -0.20: stderr 0.05, t = 3.0 < 4.30, and |-0.15| > the evaluation's 0.02.
  assert (recovery(cells("int4_sc", (0.60, 0.80, 0.70)), f32)
          == "unresolved (-0.150 ± 0.050, 3 of 3 lower)")
  # d = +0.01, -0.01, 0: mean 0 within the evaluation's 0.02.
  assert recovery(cells("int4_mis", (0.81, 0.84, 0.90)), f32) == "level (+0.000 ± 0.006, 1 of 3 lower)"
  # Identical runs: a zero standard error and a zero mean.
  assert recovery(f32, f32) == "level (+0.000 ± 0.000, 0 of 3 lower)"
  assert recovery(cells("int4_none", (0.70,)), f32) == "too few seeds (1)"
  page = spec["render_page"](f32 + cells("int4_none", (0.70, 0.74, 0.81)),
                             str(tmp_path / "low_precision.md"))
  row = _row(page, "int4")
  assert row[1:] == ["below (-0.100 ± 0.006, 3 of 3 lower)", "too few seeds (0)",
                     "too few seeds (0)", "too few seeds (0)"]
