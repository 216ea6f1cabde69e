#!/bin/sh
# Stands in for Bazel's downloaded coverage tools (BUILD says why).
echo "bazel coverage is unavailable: Arbor's Bazel build is offline and has no coverage" \
  "tools (third_party/remote_coverage_tools)." >&2
exit 1
