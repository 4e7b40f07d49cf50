"""
`transformers serve` for a directory of scripts/export.py --format=hf (nanotrain.export.hf):

    python -m nanotrain.export.hf_serve DIR --trust-remote-code --port 8000 [more `transformers serve` options]

then POST http://localhost:8000/v1/chat/completions {"model": "DIR", "messages": [...]} (OpenAI's API). `transformers
serve DIR --trust-remote-code` alone fails with "module transformers has no attribute NanotrainForCausalLM": it looks
the config's architecture up by name among transformers' own classes (transformers 5.24). This registers the
export's class (the directory's own modeling_nanotrain.py, as trust_remote_code loads it) under that name in the
transformers module and in the causal-LM names, then runs transformers' command line as `transformers serve ARGS`.
Offline: nothing is downloaded (set HF_HUB_OFFLINE=1 to be sure).
"""

import sys


def register(model_dir):
    """Makes transformers find the export in `model_dir` (a path) by its architecture's name: the class the
    directory's auto_map names for AutoModelForCausalLM, set as transformers.<architecture> and listed in
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES under the config's model_type. Returns the class. Raises what transformers
    raises for a directory that is not an export (OSError, ValueError)."""
    import transformers
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    cls = get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], model_dir)
    setattr(transformers, config.architectures[0], cls)
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(config.model_type, cls.__name__)
    return cls


def main(argv):
    """Registers the export named by the first argument (its directory), then runs `transformers serve argv`."""
    if not argv or argv[0].startswith("-"):
        sys.exit("usage: python -m nanotrain.export.hf_serve DIR --trust-remote-code [transformers serve options]")
    register(argv[0])
    from transformers.cli.transformers import main as transformers_main
    sys.argv = ["transformers", "serve", *argv]
    transformers_main()


if __name__ == "__main__":
    main(sys.argv[1:])
