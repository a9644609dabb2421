"""The profile's classifier: which XLA instructions are matmuls, AdamW-shaped or the rest."""

from __future__ import annotations

from fmnist_flax.codelab import profiling


def test_op_kinds_tells_matmuls_from_weight_shaped_and_other_work():
    hlo = """
%fused_computation.8 (param_0: f32[16,784], param_1: f32[784,256]) -> f32[16,256] {
  %dot.1 = f32[16,256]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}
}
ENTRY %main.3 (p0: f32[784,256], p1: f32[16,784]) -> (f32[784,256], f32[16,256]) {
  %ynn_fusion.8 = f32[16,256]{1,0} fusion(%p1, %p0), kind=kCustom, calls=%fused_computation.8
  %dot.9 = f32[784,256]{1,0} dot(%p1, %ynn_fusion.8), lhs_contracting_dims={0}
  %multiply_add_fusion.12 = f32[784,256]{1,0} fusion(%p0, %dot.9), kind=kLoop, calls=%fc.24
  %gelu_fusion = f32[16,256]{1,0} fusion(%ynn_fusion.8), kind=kLoop, calls=%fc.25
  %while.2 = (f32[784,256]{1,0}, s32[]) while(%tuple), condition=%cond, body=%body
  ROOT %tuple.4 = (f32[784,256]{1,0}, f32[16,256]{1,0}) tuple(%multiply_add_fusion.12, %gelu_fusion)
}
"""
    kinds = profiling.op_kinds(hlo, {(784, 256)})
    assert kinds["ynn_fusion.8"] == kinds["dot.9"] == "matmul"
    assert kinds["multiply_add_fusion.12"] == "elementwise over kernels"
    assert kinds["gelu_fusion"] == "everything else"
    assert "while.2" not in kinds  # a loop's time is its body's ops
