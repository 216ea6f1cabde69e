"""A benchmark section's results file, shared by Arbor's accelerator benchmark and its
torch peer (plain Python: the peer's virtualenv has no JAX, Arbor's no torch)."""

from __future__ import annotations

import json
import os


class Part:
  """A section's results file, rewritten whole after each case (a killed section keeps
  what it measured): `{**header, "cases": [...]}`, each case also printed as a JSON line."""

  def __init__(self, path: str, header: dict):
    self.path, self.data = path, dict(header, cases=[])
    self.write()

  def add(self, case: dict) -> None:
    self.data["cases"].append(case)
    print(json.dumps(case), flush=True)
    self.write()

  def write(self) -> None:
    with open(self.path + ".tmp", "w") as f:
      json.dump(self.data, f, indent=1)
    os.replace(self.path + ".tmp", self.path)
