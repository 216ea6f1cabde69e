"""What both peer scripts report about their own process (imported by path: each peer runs
as `python experiments/peers/<name>_peer.py`, so this folder is first on its sys.path)."""


def peak_rss_bytes() -> int:
  """Peak resident memory of this whole peer process (all its cases), for B1's memory
  column: VmHWM, not ru_maxrss, which Linux carries over from the parent across fork and
  exec (a peer started by a 2 GB benchmark process would report the parent's peak)."""
  with open("/proc/self/status", encoding="ascii") as status:
    for line in status:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("/proc/self/status has no VmHWM line (peak memory needs Linux).")
