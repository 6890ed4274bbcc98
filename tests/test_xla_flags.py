"""The XLA flags headrace sets before JAX starts."""

import os
import subprocess
import sys

from headrace import xla_flags


def test_the_memory_scheduler_is_added_unless_the_user_named_the_flag():
    assert xla_flags.with_cpu_memory_scheduler("") == xla_flags.CPU_MEMORY_SCHEDULER
    assert xla_flags.with_cpu_memory_scheduler("--a=1") == f"--a=1 {xla_flags.CPU_MEMORY_SCHEDULER}"
    mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    assert xla_flags.with_cpu_memory_scheduler(mine) == mine


def test_the_command_line_passes_the_flag_to_jax_and_its_children():
    """`headrace` sets it before JAX starts, in the environment a run's processes inherit, and
    this JAX accepts it (an unknown flag aborts the backend's start)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = ("import contextlib, io, os\nfrom headrace import cli\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    cli.main(['plan', '--help'])\n"
            "import jax\njax.devices()\nprint(os.environ['XLA_FLAGS'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [xla_flags.CPU_MEMORY_SCHEDULER]
