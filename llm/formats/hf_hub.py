"""Models named on the Hugging Face Hub, `hf:ORG/NAME`, wherever a model folder is read:

    python text_generator.py hf:HuggingFaceTB/SmolLM2-135M-Instruct
    python gpu_training_optimized.py --init_from hf:Qwen/Qwen2.5-0.5B --sources my_text/
    python export_hf.py --import hf:meta-llama/Llama-3.2-1B runs/llama --max_seq_len 2048
Only a name written hf:... reaches the network, into huggingface_hub's cache (HF_HOME) in its layout:
config.json first, checked as any folder's is (hf_families.py), and the weights and tokenizer only when it
passes. The commit, the listed names and each file's hash come through hub_client.py's listing and download,
which check them before they name a file (huggingface_hub's own downloads took them unchecked); refs/main is
written once every file is in.
With HF_HUB_OFFLINE=1, or with the Hub out of reach, the cache alone is read, and a model missing there is one
error line saying how to fetch it.
"""

import fnmatch
import os
import re

from config import ModelConfig
from llm.base.errors import CheckpointError, RunFailure
from llm.base.sizing import count_parameters
from llm.formats.hf_families import HF_CONFIG, model_config_from_hf
from llm.formats.hf_format import check_memory, is_hf_folder
from llm.hub import hub_client
from llm.hub.hub_client import Repo, offline

HF_PREFIX = "hf:"
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME as the Hub spells them
# What the reader uses: no pickled weights, no originals in other formats (Llama's repos add 16 GB of .pth).
FILES = [HF_CONFIG, "generation_config.json", "model.safetensors", "model-*.safetensors",
         "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "chat_template.jinja"]


def is_hub_name(path: str) -> bool:
    return path.startswith(HF_PREFIX)


def resolve(name: str, max_seq_len: int = 0) -> str:
    """The local folder of hf:ORG/NAME in the Hugging Face cache, downloaded first unless offline:
    config.json, then (when our model can compute it at this context and it fits in memory) the weights and
    tokenizer."""
    repo = Repo(_repo_id(name), "model", name)
    hub, errors = _hub(name)
    local = offline(hub.constants)
    try:
        listed = None if local else hub_client.listing(hub, repo, "main", _wanted)
        folder = _cached(repo, local) if listed is None else _fetch(hub, repo, *listed, max_seq_len)
    # a whole cached copy serves, as it always did
    except (errors.HfHubHTTPError, *hub_client.unreachable()) as e:
        folder = _cached(repo, local, _failure(repo, e, errors))
    if not is_hf_folder(folder):
        raise CheckpointError(f"{name} ({folder}) has no {HF_CONFIG} with safetensors "
                              "weights (model.safetensors or its shards), the only weights "
                              "read; use a model published with them")
    return folder


def hub_shape(name: str, max_seq_len: int = 0) -> ModelConfig:
    """The shape of hf:ORG/NAME from its config.json alone (a few KB; fetched unless offline or cached): what
    the trainer's fit check estimates before any weight comes."""
    repo = Repo(_repo_id(name), "model", name)
    hub, errors = _hub(name)
    commit = hub_client.cached_commit(repo, "main")
    try:
        listed = None if offline(hub.constants) else hub_client.listing(hub, repo, "main", _wanted)
    except (errors.HfHubHTTPError, *hub_client.unreachable()) as e:
        if not commit or not os.path.isfile(hub_client.snapshot_path(repo, commit, HF_CONFIG)):
            raise _failure(repo, e, errors) from None
        listed = None
    if listed is not None:
        names, commit = listed
        if HF_CONFIG not in names:
            raise CheckpointError(f"{repo.where} has no {HF_CONFIG}, it is not a transformers model")
        _get(hub, repo, commit, HF_CONFIG)
    if not commit or not os.path.isfile(hub_client.snapshot_path(repo, commit, HF_CONFIG)):
        return model_config_from_hf(_cached(repo, True), max_seq_len)  # the error line saying how to fetch it
    return model_config_from_hf(hub_client.snapshot_path(repo, commit), max_seq_len)


def _hub(name: str):
    """huggingface_hub and its errors module, or an error line saying how to install it."""
    try:
        import huggingface_hub.constants  # the package, with its constants loaded (hub.constants)
        from huggingface_hub import errors
    except ImportError:
        raise CheckpointError(f"{name} is read through the huggingface_hub "
                              "package, pip install huggingface_hub") \
            from None
    return huggingface_hub, errors


def _repo_id(name: str) -> str:
    """ORG/NAME of hf:ORG/NAME, by our pattern and then the Hub's own rule (a trailing '-', '--', over 96
    characters), which our pattern is looser than: a name that becomes a cache folder."""
    repo = name[len(HF_PREFIX):]
    if not REPO_ID.fullmatch(repo) or ".." in repo:
        raise CheckpointError(f"{name!r} is not a Hub model name, write hf:ORG/NAME (hf:Qwen/Qwen2.5-0.5B)")
    _, errors = _hub(name)
    from huggingface_hub.utils import validate_repo_id
    try:
        validate_repo_id(repo)
    except errors.HFValidationError as e:
        raise CheckpointError(f"{name[:120]!r} is not a Hub model name ({str(e).splitlines()[0][:200]}), "
                              "write hf:ORG/NAME (hf:Qwen/Qwen2.5-0.5B)") from None
    return repo


def _wanted(path: str) -> bool:
    """A file the reader uses, matched as huggingface_hub's allow_patterns were (`*` crosses folders)."""
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in FILES)


def _fetch(hub, repo: Repo, names: list, commit: str, max_seq_len: int) -> str:
    """The snapshot of commit holding the listed files: config.json first, checked before the weights are
    asked for; refs/main names it once all are in, so that an offline run finds a whole model."""
    if HF_CONFIG not in names:
        raise CheckpointError(f"{repo.where} has no {HF_CONFIG}, it is not a transformers model")
    folder = hub_client.snapshot_path(repo, commit)
    _get(hub, repo, commit, HF_CONFIG)
    # before the weights come
    check_memory(count_parameters(model_config_from_hf(folder, max_seq_len)), repo.where)
    for name in names:
        _get(hub, repo, commit, name)
    hub_client.remember(repo, "main", commit)
    return folder


def _get(hub, repo: Repo, commit: str, name: str):
    """One listed file into the snapshot, unless an earlier run brought it."""
    if not os.path.exists(hub_client.snapshot_path(repo, commit, name)):
        hub_client.download(hub, repo, name, commit)


def _failure(repo: Repo, e: Exception, errors) -> Exception:
    """huggingface_hub's failure as one line: how to get in, a token refused, or what the Hub answered."""
    if isinstance(e, errors.RepositoryNotFoundError):  # gated ones too: both say how to get in
        return CheckpointError(hub_client.not_shown(repo, isinstance(e, errors.GatedRepoError),
                                                    "no such model", "its Hub page"))
    if hub_client.refused_token(e):
        return CheckpointError(f"{repo.where}: {hub_client.refused_token(e)}")
    if isinstance(e, errors.HfHubHTTPError):
        return RunFailure(f"{repo.where}: the Hub answered {str(e).splitlines()[0]}; try again later")
    return hub_client.lost(repo, e)


def _cached(repo: Repo, by_setting: bool, failure: Exception | None = None) -> str:
    """The snapshot the cached refs/main names (checked), for a run that cannot download; else `failure`, or
    an error line saying the cache lacks it, or holds only part of it."""
    commit = hub_client.cached_commit(repo, "main")
    folder = hub_client.snapshot_path(repo, commit) if commit else ""
    if folder and is_hf_folder(folder):
        return folder
    if failure:
        raise failure from None
    why = "HF_HUB_OFFLINE=1 forbids downloading it; unset HF_HUB_OFFLINE" if by_setting else \
        "the Hub could not be reached; check the connection"
    where = "is only partly" if folder and os.path.isdir(folder) else "is not"
    raise CheckpointError(f"{repo.where} {where} in the Hugging Face cache ({os.path.dirname(repo.storage)}) "
                          f'and {why}, or fetch it with: hf download {repo.id} --include '
                          '"*.json" "model*.safetensors"')
