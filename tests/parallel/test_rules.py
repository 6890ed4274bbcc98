"""The mesh from config, the partition-rule table, overrides, fallbacks, replication check."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec

from headrace.config import ConfigError
from headrace.learner.train_step import init_state, make_optimizer
from headrace.model import params as params_lib
from headrace.model.transformer import ModelDims
from headrace.parallel import rules
from headrace.parallel.mesh import make_mesh, resolve_sizes
from tests.parallel.helpers import DIMS, learner_config

P = PartitionSpec


def _abstract_params(dims: ModelDims = DIMS):
    return jax.eval_shape(lambda: params_lib.init(dims, 0)[1])


def test_mesh_sizes_from_config():
    assert resolve_sizes({"data": 2, "fsdp": -1, "tensor": 2}, 8) == (2, 2, 2)
    assert resolve_sizes({"fsdp": -1}, 8) == (1, 8, 1)
    assert resolve_sizes({"data": 1, "fsdp": 1, "tensor": 1}, 1) == (1, 1, 1)
    with pytest.raises(ConfigError, match="multiply to 6 but there are 8 devices"):
        resolve_sizes({"data": 3, "fsdp": 2}, 8)
    with pytest.raises(ConfigError, match="do not divide"):
        resolve_sizes({"data": 3, "fsdp": -1}, 8)
    with pytest.raises(ConfigError, match="at most one"):
        resolve_sizes({"data": -1, "fsdp": -1}, 8)
    with pytest.raises(ConfigError, match="unknown axes"):
        resolve_sizes({"pipeline": 2}, 8)


def test_make_mesh_names_axes_in_order_with_auto_types():
    mesh = make_mesh({"data": 2, "fsdp": -1, "tensor": 2})
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    small = make_mesh({"fsdp": 2, "tensor": -1}, devices=jax.devices()[:4])
    assert dict(small.shape) == {"data": 1, "fsdp": 2, "tensor": 2}


@pytest.mark.timeout(60)
def test_importing_touches_no_device():
    code = ("import headrace.parallel, headrace.learner.sharded_step, headrace.parallel.rules\n"
            "from jax._src import xla_bridge\n"
            "assert not xla_bridge.backends_are_initialized()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


def test_table_splits_every_matrix_over_fsdp_and_tensor():
    plan = rules.plan_params(_abstract_params(), make_mesh({"fsdp": 4, "tensor": 2}))
    specs = {path: item.spec for path, item in plan.items()}
    assert specs["embed.embedding"] == P("tensor", "fsdp")
    assert specs["unembed.kernel"] == P("fsdp", "tensor")
    for i in range(DIMS.n_layers):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
            assert specs[f"layers.{i}.{name}.kernel"] == P("fsdp", "tensor")
        for name in ("attn.o", "mlp.down"):
            assert specs[f"layers.{i}.{name}.kernel"] == P("tensor", "fsdp")
        assert specs[f"layers.{i}.attn_norm.scale"] == P(None)
    assert not any(item.notes for item in plan.values())
    report = rules.replication_report(plan, make_mesh({"fsdp": 4, "tensor": 2}))
    assert {path for path, *_ in report.entries} == {p for p in specs if p.endswith("scale")}
    assert 0 < report.share < 0.01


def test_overrides_come_first_and_bad_ones_are_refused():
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    plan = rules.plan_params(_abstract_params(), mesh,
                             {r"embed\.embedding$": [None, ["fsdp", "tensor"]]})
    assert plan["embed.embedding"].spec == P(None, ("fsdp", "tensor"))
    assert plan["embed.embedding"].shards(mesh) == 8
    with pytest.raises(ConfigError, match="has 1 dimensions but embed.embedding"):
        rules.plan_params(_abstract_params(), mesh, {r"embed\.embedding$": ["fsdp"]})
    with pytest.raises(ConfigError, match=r"parallel.rules\['x'\]\[0\]='pipe'"):
        rules.parse_overrides({"x": ["pipe"]})
    with pytest.raises(ConfigError, match="not a regular expression"):
        rules.parse_overrides({"(": [None]})
    with pytest.raises(ConfigError, match="names an axis twice"):
        rules.plan_params(_abstract_params(), mesh, {r"unembed": ["fsdp", "fsdp"]})


def test_non_divisible_dimensions_fall_back_and_are_reported():
    dims = ModelDims(vocab_size=50, d_model=64, n_layers=1, n_heads=8, n_kv_heads=8, d_ff=128)
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    plan = rules.plan_params(_abstract_params(dims), mesh)
    assert plan["embed.embedding"].spec == P(None, "fsdp")
    assert plan["embed.embedding"].notes == ("dim 0 (50) not divisible by tensor=4: not split",)
    assert plan["unembed.kernel"].spec == P("fsdp", None)
    with pytest.raises(rules.ReplicationError, match=r"unembed.kernel: 12,800 B, 4 copies"):
        rules.replication_report(plan, mesh, max_share=0.05)
    report = rules.replication_report(plan, mesh, max_share=None)
    embed_bytes = 50 * 64 * 4
    assert report.replicated_bytes > 2 * embed_bytes and report.share > 0.05


def test_optimizer_state_mirrors_parameter_specs():
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    config = learner_config(kl_coef=0.1)
    state = jax.eval_shape(lambda: init_state(params_lib.init(DIMS, 0)[1],
                                              make_optimizer(config.optimizer), 0.1))
    plan = rules.plan_params(state.params, mesh)
    specs = rules.specs_like(state, plan)
    q = ("layers", 1, "attn", "q", "kernel")

    def at(tree, keys):
        for key in keys:
            tree = tree[key]
        return tree

    adam = specs.opt_state[1][0]
    assert at(adam.mu, q) == at(adam.nu, q) == at(specs.params, q) == at(specs.ref_params, q)
    assert at(specs.params, q) == P("fsdp", "tensor")
    assert adam.count == P() and specs.step == P()
