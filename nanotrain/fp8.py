"""
FP8 training of the transformer blocks' matmuls (--fp8=True): every block's attention projections (c_q, c_k, c_v,
c_proj) and MLP (c_fc, c_proj) become torchao's Float8Linear (torchao.float8.convert_to_float8_training, pinned in
requirements.txt), the rest stays as it was: the token and value embeddings, the lm_head (the chunked loss of
nanotrain.kernels), the small gates and the scalars. The master weights, their gradients and the optimizer state stay
fp32 parameters of the same names (a Float8Linear is an nn.Linear subclass with the same "weight"), so checkpoints,
export and inference load them into a plain GPT; only the matmuls change:
- each of the three matmuls of a Linear (output, grad_input, grad_weight) casts both operands to float8 with dynamic
  scaling (scale = fp8 max / amax of the tensor right now, no history) and runs torch._scaled_mm (output in the
  input's dtype; fp32 accumulation, the forward's with cuBLAS's fast accumulation as torchao sets it): input and weight in e4m3 (3 mantissa bits), the output gradient in e5m2 (2 bits,
  more range) with recipe "tensorwise" (one scale per tensor: torchao's default, and the float8 all-gather of FSDP2
  when sharded: enable_fsdp_float8_all_gather), or everything in e4m3 with one power-of-two scale per row ("rowwise",
  torchao's ROWWISE recipe: more accurate, slower; FSDP2 then all-gathers in bf16).
- emulate=True (--fp8_emulate=True, the tests on CPU): the same casts, the matmul in fp32 on the dequantised values
  instead of _scaled_mm (torchao's emulation mode), on any device; the numerics of the casts are the GPU's.
The same recipes as torchtitan's --model.converters=float8; nanochat's --fp8 (its own tensorwise cast around
_scaled_mm) measured +17% tokens/s at depth 24 on H100. torchao rather than our own: it is the maintained FP8
training library of the PyTorch ecosystem, pure Python around _scaled_mm (its C++ extensions are not needed; their
load messages are silenced), composes with torch.compile, DDP, FSDP2 and activation checkpointing, and its
Float8Linear keeps nn.Linear's state_dict keys. torchao is imported only when --fp8=True (it takes seconds).
"""

import dataclasses
import logging
from contextlib import contextmanager

import torch

from nanotrain.errors import UserError

RECIPES = ("tensorwise", "rowwise")
BLOCK_LINEARS = ("c_q", "c_k", "c_v", "c_proj", "c_fc")  # the block Linears converted (not ve_gate: 12 inputs)
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)
TORCHAO_PIN = "torchao==0.18.0"


def check_fp8(recipe, emulate, device):
    """
    Checks --fp8=True before anything is built: the recipe is one of RECIPES; without emulate the device is a CUDA
    GPU of compute capability >= MIN_CAPABILITY (torch.cuda.get_device_capability); torchao imports. Raises UserError
    with one line naming the flag otherwise (CPU, MPS, an A100 (8.0) ...: --fp8_emulate=True runs the casts in fp32,
    for tests, not for speed).
    """
    if recipe not in RECIPES:
        raise UserError(f"--fp8_recipe={recipe!r}: expected {' or '.join(RECIPES)}")
    if not emulate:
        if device.type != "cuda":
            raise UserError(f"--fp8=True needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: Ada, "
                            f"Hopper, Blackwell); this run is on {device.type} (--fp8_emulate=True emulates the casts "
                            f"in fp32, for tests)")
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise UserError(f"--fp8=True needs compute capability >= 8.9 (FP8 tensor cores); {name} has "
                            f"{cap[0]}.{cap[1]}: train without --fp8 (bf16)")
    _torchao()


@contextmanager
def _quiet(*names):
    """Raises the given loggers to ERROR inside the block (torchao's import warns about its optional C++ kernels)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _torchao():
    """torchao.float8, imported quietly. Raises UserError when torchao is not installed."""
    try:
        with _quiet("torchao", "torch.utils._pytree"):
            import torchao.float8 as float8
    except ImportError as exc:
        raise UserError(f"--fp8=True needs torchao: pip install {TORCHAO_PIN} (requirements.txt) ({exc})") from None
    return float8


def fp8_config(recipe="tensorwise", emulate=False, fsdp_float8_all_gather=False):
    """
    torchao's Float8LinearConfig of `recipe` (one of RECIPES): "tensorwise" is Float8LinearConfig() (e4m3 input and
    weight, e5m2 output gradient, one fp32 scale per tensor) with enable_fsdp_float8_all_gather set as asked;
    "rowwise" is Float8LinearConfig.from_recipe_name("rowwise") (e4m3 everywhere, power-of-two scales per row; no
    float8 all-gather). emulate: the matmuls in fp32 on the dequantised operands (any device). Raises UserError for
    another recipe.
    """
    if recipe not in RECIPES:
        raise UserError(f"--fp8_recipe={recipe!r}: expected {' or '.join(RECIPES)}")
    float8 = _torchao()
    if recipe == "tensorwise":
        return float8.Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    return dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def convert_to_fp8(model, recipe="tensorwise", emulate=False, fsdp_float8_all_gather=False):
    """
    Swaps, in place, the Linears of model.blocks named in BLOCK_LINEARS whose in and out features are multiples of
    16 (what _scaled_mm needs; model_dim = 64 * depth always is) for torchao Float8Linear of fp8_config(recipe,
    emulate, fsdp_float8_all_gather), keeping each weight Parameter (same tensor, same name, fp32), each running
    under any device's autocast as torchao runs it under CUDA's (_autocast_outside). Call it on the
    built (and loaded) GPT before FSDP sharding, torch.compile, DDP and setup_optimizers. Returns the converted
    modules' names (list[str], e.g. "blocks.0.attn.c_q").
    """
    float8 = _torchao()
    names = []

    def keep(module, fqn):
        ok = (fqn.rsplit(".", 1)[-1] in BLOCK_LINEARS and module.in_features % 16 == 0
              and module.out_features % 16 == 0)
        if ok:
            names.append(f"blocks.{fqn}")
        return ok
    float8.convert_to_float8_training(model.blocks, module_filter_fn=keep,
                                      config=fp8_config(recipe, emulate, fsdp_float8_all_gather))
    for name in names:
        module = model.get_submodule(name)
        module.forward = _autocast_outside(module.forward)
    return names


def _autocast_outside(forward):
    """
    A Float8Linear's forward under autocast on any device: torchao casts the input to CUDA's autocast dtype itself
    (its forward reads only the GPU autocast state), but under a CPU autocast the matmul of its float8 tensors would be
    autocast's again and fails (aten.to.dtype on a float8 tensor). So on a device other than CUDA with autocast on,
    the input goes in the autocast dtype with autocast off inside, which is what torchao does on CUDA (the output in
    the autocast dtype).
    """
    def wrapped(x):
        kind = x.device.type
        if kind != "cuda" and torch.is_autocast_enabled(kind):
            with torch.autocast(kind, enabled=False):
                return forward(x.to(torch.get_autocast_dtype(kind)))
        return forward(x)
    return wrapped


def plain_tensor(t):
    """t as a plain torch.Tensor: the fp32 tensor inside torchao's float8 all-gather weight wrapper
    (WeightWithDynamicFloat8CastTensor, a Parameter's data under FSDP2 with --fp8), else t itself."""
    inner = getattr(t, "_tensor", None)
    if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and isinstance(inner, torch.Tensor):
        return inner.detach()
    return t


def describe(names, recipe, emulate):
    """The one line base_train and bench print about --fp8=True (names: convert_to_fp8's result)."""
    return (f"FP8: {len(names)} block Linears in float8 ({recipe} scaling{', emulated in fp32' if emulate else ''}); "
            f"embeddings, lm_head and gates in the compute dtype; fp32 master weights and optimizer state")
