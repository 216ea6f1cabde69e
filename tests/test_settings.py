"""The settings base (rl/settings/): choices given as a function are read when a field is
checked (so a settings module need not import the library that defines them), and those
fields are refused through the launcher like any other."""

import dataclasses

import pytest

from rl.settings import Settings, setting
from rl.settings import model as model_settings
from rl.settings import rollout as rollout_settings
from rl.settings import run as run_settings
from tests.launcher_config import default_run_config, refusal


def test_choices_from_a_function_are_read_when_the_field_is_checked():
  calls = []

  def modes():
    calls.append(1)
    return ("a", "b")

  @dataclasses.dataclass(frozen=True)
  class Section(Settings):
    SECTION = "section"
    mode: str = setting("a", "a mode", choices=modes)

  assert calls == []  # declaring the class reads nothing
  Section(mode="b").check()
  with pytest.raises(ValueError, match=r"^config.section.mode = 'c'; use one of 'a', 'b'.$"):
    Section(mode="c").check()
  assert len(calls) == 2


def test_the_libraries_choices_are_checked_above_the_settings():
  """config.model.remat and config.rollout.resume take the libraries' own names, checked by
  rl.composition (the settings import nothing above them)."""
  from models import transformer  # pylint: disable=import-outside-toplevel
  from rl import composition  # pylint: disable=import-outside-toplevel
  from sampling import partial  # pylint: disable=import-outside-toplevel
  for remat in transformer.REMAT_POLICIES:
    composition.check_names(run_settings.RunSettings(
        model=model_settings.ModelSettings(remat=remat)))
  for resume in partial.RESUME_MODES:
    composition.check_names(run_settings.RunSettings(
        rollout=rollout_settings.RolloutSettings(kind="partial", resume=resume)))
  with pytest.raises(ValueError, match="config.model.remat = 'some'; use one of 'none', "
                     "'full', 'dots'"):
    composition.check_names(run_settings.RunSettings(
        model=model_settings.ModelSettings(remat="some")))


@pytest.mark.parametrize("overrides,message", [
    ({"model.remat": "some"}, "config.model.remat = 'some'; use one of"),
    ({"rollout.kind": "partial", "rollout.resume": "never"},
     "config.rollout.resume = 'never'; use one of"),
])
def test_the_launcher_refuses_a_value_outside_lazy_choices(tmp_path, overrides, message):
  assert message in refusal(default_run_config(tmp_path / "run", overrides))


def test_check_ranges_skips_only_the_unread_refusal():
  """A component given its settings directly (`Turns`, with its environment object) checks
  ranges only: a budget set without an environment name passes there and is refused by the
  launcher's full check; a budget out of range is refused by both."""
  from rl.settings.tools import ToolSettings  # pylint: disable=import-outside-toplevel
  ToolSettings(max_turns=2).check_ranges()
  with pytest.raises(ValueError, match="config.tools.max_turns = 2 has no effect"):
    ToolSettings(max_turns=2).check()
  for check in (ToolSettings(max_turns=0).check_ranges, ToolSettings(max_turns=0).check):
    with pytest.raises(ValueError, match=r"config.tools.max_turns = 0 must be >= 1"):
      check()
