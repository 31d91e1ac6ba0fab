"""Collectives read from compiled HLO text: kinds, bytes per device, loop trips, and
which cross slices (`tfjax.parallel.collectives`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from tfjax.parallel.collectives import Collective, collectives, dcn_totals

HLO = """HloModule m, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  %n = s32[]{:T(128)} constant(3)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p.1 = (s32[], f32[4]{0}) parameter(0)
  %x.1 = f32[4]{0} get-tuple-element(%p.1), index=1
  %ag = f32[16]{0} all-gather(%x.1), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  ROOT %t = (s32[], f32[4]{0}) tuple(%i.1, %x.1)
}

ENTRY %main (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %ar = f32[8,16]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ar2 = bf16[8,16]{1,0} all-reduce-start(%y), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
  %y = bf16[8,16]{1,0} convert(%x)
  %cp = f32[8,16]{1,0} collective-permute(%x), channel_id=4, source_target_pairs={{0,1},{3,4}}
  %tok = token[] after-all()
  %snd = (f32[2,16]{1,0:T(2,128)}, u32[], token[]) send(%z, %tok), channel_id=5, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %z = f32[2,16]{1,0} slice(%x), slice={[0:2], [0:16]}
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8,16]{1,0} copy(%ar)
}
"""
SLICES = [0, 0, 0, 0, 1, 1, 1, 1]  # devices 0-3 one slice, 4-7 the other


def test_kinds_bytes_trips_and_slices():
    got = collectives(HLO, SLICES)
    assert got == [
        Collective("all-gather", 16, 3, True),  # iota groups {0,2,4,6},{1,3,5,7}; 3 trips
        Collective("all-reduce", 512, 1, False),  # {0..3},{4..7}: within each slice
        Collective("all-reduce", 256, 1, True),  # the -start form; bf16 operand
        Collective("collective-permute", 512, 1, True),  # 3 -> 4 crosses
        Collective("all-reduce", 128, 1, True),  # a Megascale transfer always crosses
    ]
    assert dcn_totals(got) == {"all-reduce": (2, 384), "all-gather": (3, 48),
                               "collective-permute": (1, 512)}
    # one slice: only the Megascale transfer crosses; no slices given: the same
    assert dcn_totals(collectives(HLO, [0] * 8)) == {"all-reduce": (1, 128)}
    assert dcn_totals(collectives(HLO)) == {"all-reduce": (1, 128)}
    assert collectives("") == [] and dcn_totals([]) == {}


def test_a_program_compiled_for_a_permuted_mesh():
    """The groups in compiled HLO index the program's devices in `mesh.devices.flat`
    order: on a mesh whose rows mix two 'slices' (devices 0-3, 4-7), the sum over the
    rows crosses and the sum down the columns does not."""
    devices = jax.devices()
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    mesh = Mesh(np.asarray([devices[i] for i in order]).reshape(2, 4), ("a", "b"),
                axis_types=(AxisType.Auto,) * 2)
    slice_of = [d.id // 4 for d in mesh.devices.flat]

    def f(x):  # [1, 4] per device: a sum over 'b' (a row) and one over 'a' (a column)
        return jax.lax.psum(x, "b"), jax.lax.psum(x * 2, "a")

    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b")))
    x = jax.ShapeDtypeStruct((2, 16), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))
    got = collectives(step.lower(x).compile().as_text(), slice_of)
    assert sorted((c.kind, c.bytes, c.dcn) for c in got) == [
        ("all-reduce", 16, False), ("all-reduce", 16, True)]
    rows = [c for c in got if c.dcn]
    assert dcn_totals(got) == {"all-reduce": (1, 16)} and rows[0].count == 1


@pytest.mark.parametrize("attrs", ["replica_groups={}", ""])
def test_no_groups_means_every_device(attrs):
    hlo = ("ENTRY %main (x: f32[4]) -> f32[4] {\n  %x = f32[4]{0} parameter(0)\n"
           f"  ROOT %ar = f32[4]{{0}} all-reduce(%x), channel_id=1, {attrs}\n}}\n")
    assert collectives(hlo, [0, 1]) == [Collective("all-reduce", 16, 1, True)]
    assert collectives(hlo, [0, 0]) == [Collective("all-reduce", 16, 1, False)]
