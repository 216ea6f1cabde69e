"""Offline stand-in for @rules_java//java:defs.bzl: Bazel's native Java rules under their names.

Bazel 4 resolves toolchains for every test, which parses its registered Java toolchains
(@bazel_tools//tools/jdk), whose BUILD files load this file from @rules_java. Bazel would
otherwise download rules_java from GitHub; Arbor builds offline and has no Java of its own,
so the WORKSPACE maps @rules_java to this folder. Each macro forwards to the native rule,
as rules_java itself does.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_proto_library(**attrs):
    native.java_proto_library(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
