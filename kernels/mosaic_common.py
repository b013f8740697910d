"""Helpers shared by the Pallas Mosaic GPU kernels (Hopper: decode projections
``skinny_matmul_mosaic``, decode attention ``paged_attention_mosaic``): the operand types and
tiles wgmma takes, the shared-memory limit, the kernels' launch settings."""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

DTYPES = (jnp.bfloat16, jnp.float16)    # wgmma reads a transposed SMEM operand only in 16 bits
TILE = 64                   # elements of a 128-byte swizzle row in 16 bits
SWIZZLE = 128
SMEM_LIMIT = 227 * 1024     # an H100 / H200 block's opt-in shared memory


def hopper(device) -> bool:
    """Whether the kernels run on this device: a GPU of compute capability 9.x."""
    return str(getattr(device, "compute_capability", "")).startswith("9.")


def swizzled():
    """The SMEM layout wgmma and TMA share: (8, 64) tiles, 128-byte swizzled."""
    return plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(SWIZZLE)


def launch_settings(interpret) -> dict:
    """plgpu.kernel's compiler params (warpgroup semantics) and interpret argument: True or an
    ``InterpretGPUParams`` runs Mosaic GPU's interpreter (CPU)."""
    return dict(compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                interpret=(plgpu.InterpretGPUParams() if interpret is True else interpret) or None)
