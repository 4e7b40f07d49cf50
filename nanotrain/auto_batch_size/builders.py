"""
The models the automatic batch size probes: build_probe(device) -> (model, optimizers) exactly as a stage trains
them (gpt_builder for base_train and mid_train, sft_builder for chat_sft's packed or padded rows), each carrying the
key_fields that tell its cache entries apart.
"""

import torch

from nanotrain.fp8 import convert_to_fp8
from nanotrain.gpt import GPT, policy_name
from nanotrain.optim import setup_optimizers
from nanotrain.osft import DEFAULT_MATRICES, OSFT


def gpt_builder(model_config, *, activation_checkpointing="none", osft_rank_ratio=0.0, osft_matrices=DEFAULT_MATRICES,
                fp8_recipe=None, fp8_emulate=False, **optimizer_kwargs):
    """
    A build_probe(device) -> (model, [adamw, muon]) for nanotrain.gpt.GPT: created directly on `device` (works under
    FakeTensorMode, unlike meta + to_empty), init_weights(), activation_checkpointing set as training sets it (a
    nanotrain.gpt policy name, checked, kept in the model and the key), fresh
    optimizers from setup_optimizers(**optimizer_kwargs), and with osft_rank_ratio > 0 the OSFT bases (allocated,
    not computed) and projection hooks, so the probed step holds what an OSFT step holds; with fp8_recipe (one of
    nanotrain.fp8.RECIPES; None: no fp8) the block Linears in float8 as --fp8=True trains them (fp8_emulate: the
    emulated casts); advances torch's global RNG. It carries `key_fields` (GPT config, activation checkpointing, OSFT,
    fp8, optimizer arguments) for the cache key, so another model never hits its entry.
    """
    policy = policy_name(activation_checkpointing)

    def build_probe(device):
        with torch.device(device):
            model = GPT(model_config)
        model.init_weights()
        if fp8_recipe is not None:
            convert_to_fp8(model, fp8_recipe, fp8_emulate)
        model.activation_checkpointing = policy
        optimizers = setup_optimizers(model, **optimizer_kwargs)
        if osft_rank_ratio > 0:
            model.osft = OSFT(model, osft_rank_ratio, osft_matrices, allocate_only=True)  # kept alive with the model
            model.osft.attach(optimizers)
        return model, optimizers

    build_probe.key_fields = {"gpt_config": dict(vars(model_config)), "optimizer_kwargs": dict(optimizer_kwargs),
                              "activation_checkpointing": policy}
    if fp8_recipe is not None:
        build_probe.key_fields["fp8"] = [fp8_recipe, bool(fp8_emulate)]
    if osft_rank_ratio > 0:
        build_probe.key_fields["osft"] = [float(osft_rank_ratio), osft_matrices]
    return build_probe


class PackedRows(torch.nn.Module):
    """The memory shape chat_sft trains, for the probes: (B, T) rows as one packed row of B*T tokens in B segments
    (block-diagonal attention), or as B padded rows with packing=False."""

    def __init__(self, model, packing):
        super().__init__()
        self.model, self.packing = model, packing

    def forward(self, x, y):
        if not self.packing:
            return self.model(x, y)
        B, T = x.shape
        doc_ids = torch.arange(B, device=x.device).repeat_interleave(T).view(1, B * T)
        return self.model(x.reshape(1, B * T), y.reshape(1, B * T), doc_ids=doc_ids)


def sft_builder(model_config, packing, activation_checkpointing="none", **kwargs):
    """build_probe(device) -> (PackedRows(GPT), [adamw, muon]) for chat_sft: gpt_builder's model (kwargs: its OSFT
    and optimizer arguments) wrapped in PackedRows; key_fields also hold `packing`."""
    build_gpt = gpt_builder(model_config, activation_checkpointing=activation_checkpointing, **kwargs)

    def build_probe(device):
        model, optimizers = build_gpt(device)
        return PackedRows(model, packing), optimizers
    build_probe.key_fields = {**build_gpt.key_fields, "packing": packing}
    return build_probe
