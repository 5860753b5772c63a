"""Models named on the Hugging Face Hub, `hf:ORG/NAME`, wherever a model folder is read:

    python text_generator.py hf:HuggingFaceTB/SmolLM2-135M-Instruct
    python gpu_training_optimized.py --init_from hf:Qwen/Qwen2.5-0.5B --sources my_text/
    python export_hf.py --import hf:meta-llama/Llama-3.2-1B runs/llama --max_seq_len 2048
Only a name written hf:... reaches the network, through huggingface_hub into its cache (HF_HOME): config.json
first, checked as any folder's is (hf_families.py), and the weights and tokenizer only when it passes. With
HF_HUB_OFFLINE=1 the cache alone is read, and a model missing there is one error line saying how to fetch it.
"""

import os
import re

from llm.errors import CheckpointError, RunFailure
from llm.hf_datasets import offline
from llm.hf_families import HF_CONFIG, model_config_from_hf
from llm.hf_format import check_memory, is_hf_folder
from llm.sizing import count_parameters

HF_PREFIX = "hf:"
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME as the Hub spells them
# What the reader uses: no pickled weights, no originals in other formats (Llama's repos add 16 GB of .pth).
FILES = [HF_CONFIG, "generation_config.json", "model.safetensors", "model-*.safetensors",
         "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "chat_template.jinja"]


def is_hub_name(path: str) -> bool:
    return path.startswith(HF_PREFIX)


def resolve(name: str, max_seq_len: int = 0) -> str:
    """The local folder of hf:ORG/NAME in the Hugging Face cache, downloaded first unless offline: config.json,
    then (when our model can compute it at this context and it fits in memory) the weights and tokenizer."""
    repo = name[len(HF_PREFIX):]
    if not REPO_ID.fullmatch(repo) or ".." in repo:
        raise CheckpointError(f"{name!r} is not a Hub model name, write hf:ORG/NAME (hf:Qwen/Qwen2.5-0.5B)")
    try:
        import huggingface_hub as hub
        from huggingface_hub import constants, errors
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        raise CheckpointError(f"{name} is read through the huggingface_hub package, pip install huggingface_hub") \
            from None
    try:  # the Hub's own rule (a trailing '-', '--', over 96 characters), which our pattern is looser than
        validate_repo_id(repo)
    except errors.HFValidationError as e:
        raise CheckpointError(f"{name[:120]!r} is not a Hub model name ({str(e).splitlines()[0][:200]}), write "
                              "hf:ORG/NAME (hf:Qwen/Qwen2.5-0.5B)") from None
    local = offline(constants)
    fetch = f'fetch it with: hf download {repo} --include "*.json" "model*.safetensors"'
    try:
        if not local:
            config = hub.hf_hub_download(repo, HF_CONFIG)
            cfg = model_config_from_hf(os.path.dirname(config), max_seq_len)  # refused before the weights come
            check_memory(count_parameters(cfg), name)
        folder = hub.snapshot_download(repo, allow_patterns=FILES, local_files_only=local)
    except errors.RepositoryNotFoundError as e:  # gated ones too: both say how to get in
        gated = isinstance(e, errors.GatedRepoError)
        raise CheckpointError(f"{name}: " + ("the model is gated, accept its terms on its Hub page and log in with "
                                             "`hf auth login`" if gated else "no such model on the Hub (a private "
                                             "one needs `hf auth login`), check the name")) from None
    except errors.LocalEntryNotFoundError as e:  # not in the cache, or only part of it, and no download allowed
        why = "HF_HUB_OFFLINE=1 forbids downloading it; unset HF_HUB_OFFLINE" if local else \
            "the Hub could not be reached; check the connection"
        where = "is only partly" if isinstance(e, getattr(errors, "IncompleteSnapshotError", ())) else "is not"
        raise CheckpointError(f"{name} {where} in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}, or "
                              f"{fetch}") from None
    except (errors.EntryNotFoundError, getattr(errors, "RemoteEntryNotFoundError", ())):
        raise CheckpointError(f"{name} has no {HF_CONFIG}, it is not a transformers model") from None
    except errors.HfHubHTTPError as e:
        raise RunFailure(f"{name}: the Hub answered {str(e).splitlines()[0]}; try again later") from None
    if not is_hf_folder(folder):
        raise CheckpointError(f"{name} ({folder}) has no {HF_CONFIG} with safetensors weights (model.safetensors "
                              "or its shards), the only weights read; use a model published with them")
    return folder
