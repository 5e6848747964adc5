"""What the tests and the benchmarks share (neither imports the other's modules for it): local CPU engines as
processes, network namespaces that put services on hosts of their own, a fixed GRPO rollout, small PNG images, a
function run on a group of gloo ranks."""
