"""Offline stand-in for @rules_cc//cc:defs.bzl: Bazel's native C++ rules under their names.

Bazel 4 resolves toolchains for every test, which loads its autoconfigured C++ toolchain
(@local_config_cc), whose BUILD file loads this file from @rules_cc. Bazel would otherwise
download rules_cc from GitHub; Arbor builds offline and has no C++ of its own, so the
WORKSPACE maps @rules_cc to this folder. Each macro forwards to the native rule, as
rules_cc 0.0.1 itself does.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
