#!/bin/sh
echo "bazel coverage is not supported in this offline build (@remote_coverage_tools is a local stand-in)" >&2
exit 1
