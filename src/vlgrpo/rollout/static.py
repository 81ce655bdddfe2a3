"""Rollout engine with a static KV cache and the whole decode step captured in one CUDA graph.

Same interface, sampling and outputs as HFEngine (keyed sampling, banned vision tokens, EOS
masking: HFEngine.generate does the chunking and the masking), built for speed on a GPU:
- prefill: each run of identical prompt rows (the n samples of a prompt) is encoded once, images
  and videos included, by the model's own forward (policy.prefix_forward); its keys/values are copied into a
  static cache one row per sample, right-aligned at the prompt width, and the first token is
  sampled from its last logits;
- decode: one step embeds the last token, applies rope at the row's next text position (the three
  Qwen2.5-VL rope axes are equal for text after the prompt, so this is plain rope, as a text-only
  model's is), writes the new key/value into the cache, attends over the row's own keys (on a GPU
  in bf16/fp16 one Triton kernel, decode_attention; else SDPA over the whole cache under a row mask),
  runs the model's own projections (a layer's query, key and value ones as one GEMM over their
  weights stacked, where all three are plain Linear layers: not under LoRA), MLPs and LM head,
  its RMSNorms as one fused call each (F.rms_norm: float32 inside, one rounding instead of two in
  bf16), and samples the next token with keyed_sample, all on the device. Step counters live in
  device tensors, so on CUDA the step is captured once per shape (rows, cache width bucket,
  sampling parameters) and replayed without host work. With ignore_eos, EOS is never sampled, as
  the hf engine's generate (min_new_tokens) does.

A captured step reads its weights where they were at the capture. A model sharded with FSDP2 is
gathered afresh for each rollout, to new places: there the decoder keeps its own copy of the weights
the step reads (loaded each call, where the call's rows fit beside it), so its graph outlives the
gathering. Where the step attends each row's own keys, a decoder also serves later calls of as many
rows whose prompts are narrower than its cache: a new one is made when the prompts outgrow it. Told the
longest prompt to come (`widest_prompt`: the trainer's longest filtered prompt), a decoder's cache is
made that wide at once, where every row still fits in one call: one capture for the training steps
of a process.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from vlgrpo import distributed, models
from vlgrpo.batch import PromptBatch
from vlgrpo.policy import fused_rms_norm, prefix_forward, prompt_runs
from vlgrpo.rollout import SamplingParams, decode_attention
from vlgrpo.rollout.hf import HFEngine
from vlgrpo.rollout.sampling import keyed_sample

WIDTH_BUCKET = 128  # cache widths are rounded up to this, so most steps reuse the captured graph
PREFILL_TOKENS = 32768  # padded prompt tokens per prefill forward: bounds its activation memory
# Where the decode attention kernel does not serve, the captured decode step may use cuDNN's attention
# whatever model.cudnn_attention says: its shape is fixed, so cuDNN builds its execution plan once
# (H200, 601 rows: 20.4 ms a step with it, 24.7 with memory-efficient attention).
DECODE_ATTENTION = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
EOS_CHECK_EVERY = 32  # decode steps between host checks that every row has ended

log = logging.getLogger(__name__)


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take on `device`: free on the card plus what the caching allocator
    holds unused, within the process's share (torch.cuda.set_per_process_memory_fraction, which
    the allocator enforces); None off CUDA (no bound)."""
    if device.type != "cuda":
        return None
    card_free, total = torch.cuda.mem_get_info(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device) if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
    return min(card_free + reserved, int(fraction * total)) - allocated


def _cache_width(prompt_width: int, max_tokens: int) -> int:
    """Cache columns for prompts `prompt_width` wide and `max_tokens` response tokens, rounded up to WIDTH_BUCKET."""
    return -(-(prompt_width + max_tokens - 1) // WIDTH_BUCKET) * WIDTH_BUCKET


def _qkv(layer) -> tuple:
    """A decoder layer's query, key and value projections, in the order their weights are stacked."""
    return layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj


def _stackable(projections) -> bool:
    """Whether each layer's query, key and value projections can run as one GEMM: all plain Linear layers
    (peft's LoRA layers add their adapters in forward), with a bias in all three or in none."""
    return not (any(type(m) is not torch.nn.Linear for trio in projections for m in trio)
                or any(len({m.bias is None for m in trio}) > 1 for trio in projections))


def _stacked_qkv_bytes(layers) -> int:
    """Bytes of a decoder's stacked query, key and value weights and biases (_stacked_qkv); 0 where unstacked."""
    projections = [_qkv(layer) for layer in layers]
    if not _stackable(projections):
        return 0
    return sum(m.weight.nbytes + (0 if m.bias is None else m.bias.nbytes) for trio in projections for m in trio)


def _stacked_qkv(layers, device, dtype) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """Per layer, room for its query, key and value projections' weights (and biases) stacked in that
    order: ((H + 2 KV) D, hidden) and ((H + 2 KV) D,). None where they are not _stackable: the step
    then calls the three modules."""
    projections = [_qkv(layer) for layer in layers]
    if not _stackable(projections):
        log.info("static engine: the query, key and value projections are not plain Linear layers alike "
                 "(%s); the decode step runs each on its own", type(projections[0][0]).__name__)
        return None
    stacked = []
    for trio in projections:
        rows = sum(m.out_features for m in trio)
        bias = None if trio[0].bias is None else torch.empty(rows, device=device, dtype=dtype)
        stacked.append((torch.empty(rows, trio[0].in_features, device=device, dtype=dtype), bias))
    return stacked


def _read_weights(model, stacked: bool) -> list[tuple[torch.nn.Module, str]]:
    """The (module, parameter name) pairs the decode step reads: the text model's and the LM head's,
    less the query, key and value projections' where the decoder stacks its own copy of them."""
    lm = models.text_model(model)
    skip = {id(m) for layer in lm.layers for m in _qkv(layer)} if stacked else set()
    return [(module, name) for module in [*lm.modules(), model.lm_head] if id(module) not in skip
            for name, p in module._parameters.items() if p is not None]


def _own_weights_bytes(model, stacked: bool) -> int:
    """Bytes of a decoder's own copy of the weights it reads (each shared one once)."""
    weights = {id(p): p for module, name in _read_weights(model, stacked) for p in [module._parameters[name]]}
    return sum(p.nbytes for p in weights.values())


def _weight_bytes(model, own: bool) -> int:
    """Bytes of a new decoder's weights: its stacked q/k/v, and its own copy of the rest if it keeps one."""
    stacked = _stacked_qkv_bytes(models.text_model(model).layers)
    return stacked + (_own_weights_bytes(model, stacked > 0) if own else 0)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class _Decoder:
    """Static buffers and the decode step for `rows` sequences in a cache `width` positions wide."""

    def __init__(self, model, rows: int, width: int, max_tokens: int, params: SamplingParams, banned, eos_ids, pad_id,
                 own_weights: bool = False):
        lm = models.text_model(model)
        text = lm.config
        self.layers, self.norm, self.embed, self.head = lm.layers, lm.norm, lm.embed_tokens, model.lm_head
        self.inv_freq, self.rope_scale = lm.rotary_emb.inv_freq, lm.rotary_emb.attention_scaling
        self.heads, self.kv_heads = text.num_attention_heads, text.num_key_value_heads
        self.head_dim = models.head_dim(text)
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")  # Qwen3: RMSNorm per head before rope
        self.params, self.banned, self.eos, self.pad_id = params, banned, eos_ids, pad_id
        device, dtype = model.device, model.dtype
        self.qkv = _stacked_qkv(self.layers, device, dtype)  # filled from the model by load_weights
        # own_weights: (module, name) pairs the step reads and, per distinct parameter, this decoder's copy
        self.reads = _read_weights(model, self.qkv is not None) if own_weights else []
        self.own = {}
        for module, name in self.reads:
            p = module._parameters[name]
            self.own.setdefault(id(p), torch.empty(p.shape, device=p.device, dtype=p.dtype))
        shape = (len(self.layers), rows, self.kv_heads, width, self.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.mask = torch.zeros(rows, width, device=device, dtype=torch.bool)  # keys a row may attend to
        # The kernel's keys for a row: the columns from its first real prompt token (prompts are left-padded,
        # right-aligned at the prompt width) to the token fed; per row and key/value head, as it takes them.
        self.own_keys = _attends_own_keys(model)
        self.key_starts = torch.zeros(rows * self.kv_heads, device=device, dtype=torch.int32)
        self.prompt_keys = torch.zeros(rows * self.kv_heads, device=device, dtype=torch.int32)
        self.tokens = torch.zeros(rows, device=device, dtype=torch.long)  # the token fed at this step
        self.keys = torch.zeros(rows, device=device, dtype=torch.long)
        self.position = torch.zeros(rows, device=device, dtype=torch.long)  # rope position of response token 0
        self.prompt_width = torch.zeros(1, device=device, dtype=torch.long)  # cache column of response token 0
        self.step_index = torch.zeros(1, device=device, dtype=torch.long)  # t: response token t is fed
        self.out_tokens = torch.zeros(rows, max_tokens, device=device, dtype=torch.long)
        self.out_logp = torch.zeros(rows, max_tokens, device=device, dtype=torch.float32)
        self.finished = torch.zeros(rows, device=device, dtype=torch.bool)
        self.graph = None

    @property
    def weight_bytes(self) -> int:
        """Bytes of its stacked q/k/v and its own copy of the weights (_weight_bytes)."""
        stacked = sum(w.nbytes + (0 if b is None else b.nbytes) for w, b in self.qkv or [])
        return stacked + sum(t.nbytes for t in self.own.values())

    def serves(self, width: int) -> bool:
        """Whether a call needing a cache `width` wide can run on this decoder: as wide, or narrower where
        the step attends each row's own keys (the masked step would also read the columns beyond)."""
        return self.mask.shape[1] == width or (self.own_keys and self.mask.shape[1] > width)

    def load_weights(self) -> None:
        """Copy the layers' query, key and value weights into the stacked ones, and the weights the step
        reads into its own copy if it keeps one: the policy's weights change between calls, the captured
        step reads the copies where they are."""
        for layer, (weight, bias) in zip(self.layers, self.qkv or []):
            trio = _qkv(layer)
            torch.cat([m.weight for m in trio], out=weight)
            if bias is not None:
                torch.cat([m.bias for m in trio], out=bias)
        for module, name in self.reads:
            p = module._parameters[name]
            self.own[id(p)].copy_(p)

    @contextlib.contextmanager
    def reading_own_weights(self):
        """The model's modules hold this decoder's copy of the weights the step reads, for the block
        (the step calls the modules; none is an FSDP unit, so no gathering runs meanwhile)."""
        held = [(module, name, module._parameters[name]) for module, name in self.reads]
        for module, name, p in held:
            module._parameters[name] = self.own[id(p)]
        try:
            yield
        finally:
            for module, name, p in held:
                module._parameters[name] = p

    def count_prompt_keys(self) -> None:
        """After the prefill: where each row's keys start in the cache and how many its prompt has."""
        rows, width = self.mask.shape
        prompt = self.mask.sum(-1, dtype=torch.int32).repeat_interleave(self.kv_heads)  # (rows KV,)
        pairs = torch.arange(rows * self.kv_heads, device=prompt.device, dtype=torch.int32)
        self.key_starts.copy_(pairs * width + self.prompt_width.int() - prompt)
        self.prompt_keys.copy_(prompt)

    def step(self) -> None:
        """Feed response token t, sample token t + 1 (buffers in, buffers out)."""
        t, rows = self.step_index, self.tokens.shape[0]
        write = self.prompt_width + t
        if self.own_keys:
            counts = self.prompt_keys + (t + 1).int()  # (rows KV,) the prompt's keys and response tokens 0..t
        else:
            self.mask.index_fill_(1, write, True)
            attend = self.mask[:, None, None, :]
        freqs = (self.position + t)[:, None].float() * self.inv_freq[None, :]  # (rows, D/2), as the model's rope
        emb = torch.cat([freqs, freqs], dim=-1)
        x = self.embed(self.tokens)  # (rows, H)
        cos = (emb.cos() * self.rope_scale).to(x.dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scale).to(x.dtype)[:, None, :]
        group, heads = self.heads // self.kv_heads, self.heads + self.kv_heads  # heads: query and key heads
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = fused_rms_norm(layer.input_layernorm, x)
            if self.qkv is not None:
                qkv = F.linear(h, *self.qkv[i])  # (rows, (H + 2 KV) D)
                qk, v = qkv[:, : heads * self.head_dim].view(rows, heads, self.head_dim), qkv[:, heads * self.head_dim :]
            else:
                qk = torch.cat([attn.q_proj(h).view(rows, self.heads, self.head_dim),
                                attn.k_proj(h).view(rows, self.kv_heads, self.head_dim)], dim=1)
                v = attn.v_proj(h)
            v = v.view(rows, self.kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = qk.split([self.heads, self.kv_heads], dim=1)
                qk = torch.cat([fused_rms_norm(attn.q_norm, q), fused_rms_norm(attn.k_norm, k)], dim=1)
            qk = qk * cos + _rotate_half(qk) * sin  # queries and keys rotated together: half the kernels
            q, k = qk.split([self.heads, self.kv_heads], dim=1)
            self.k[i].index_copy_(2, write, k[:, :, None])
            self.v[i].index_copy_(2, write, v[:, :, None])
            # The query heads of one key/value head form the query rows of one attention call.
            q = q.view(rows, self.kv_heads, group, self.head_dim)
            if self.own_keys:
                o = decode_attention.rows_attention(q, self.k[i], self.v[i], self.key_starts, counts, attn.scaling)
            else:
                o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=attend, scale=attn.scaling)
            x = x + attn.o_proj(o.reshape(rows, self.heads * self.head_dim))
            x = x + layer.mlp(fused_rms_norm(layer.post_attention_layernorm, x))
        logits = self.head(fused_rms_norm(self.norm, x))
        p = self.params
        tokens, logp = keyed_sample(logits, self.keys, t + 1, p.temperature, p.top_p, self.banned, p.top_k)
        self.tokens.copy_(tokens)
        self.out_tokens.index_copy_(1, t + 1, tokens[:, None])
        self.out_logp.index_copy_(1, t + 1, logp[:, None])
        self.finished |= torch.isin(tokens, self.eos)
        self.step_index.add_(1)

    def capture(self) -> None:
        """Record the step as a CUDA graph (one eager warm-up on a side stream first, as CUDA graphs need)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with sdpa_kernel(DECODE_ATTENTION), self.reading_own_weights():
            with torch.cuda.stream(stream):
                self.step()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: a checkpoint written behind the validation copies from other threads meanwhile
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.step()

    def run(self, steps: int, stop_at_eos: bool, progress) -> None:
        with self.reading_own_weights():
            for i in range(steps):
                self.graph.replay() if self.graph is not None else self.step()
                progress.update(1)
                if stop_at_eos and (i + 1) % EOS_CHECK_EVERY == 0 and bool(self.finished.all()):
                    break


def _attends_own_keys(model) -> bool:
    """Whether the decode step of `model` attends each row's own keys (the Triton kernel), so that a cache
    wider than a call's prompts costs only its memory."""
    return decode_attention.serves(model.device.type, model.dtype, models.head_dim(models.text_model(model).config))


class StaticEngine(HFEngine):
    def __init__(self, model, processor, cuda_graph: bool = True, widest_prompt: int = 0):
        """widest_prompt: the longest prompt (tokens) later calls will bring, 0 if not known: where the step
        attends each row's own keys, a new decoder's cache is made wide enough for it."""
        super().__init__(model, processor)
        self.cuda_graph = cuda_graph and model.device.type == "cuda"
        self.widest_prompt = widest_prompt
        self._decoder: _Decoder | None = None
        self._key = None
        self._own = False  # this call's decoder keeps its own copy of the weights (generate decides)
        self._prompt_room = 0  # prompt tokens this call's cache makes room for, at least its prompts' (generate decides)
        self.decoders = 0  # decoders built so far
        self.captures = 0  # CUDA graphs recorded so far

    def generate(self, prompts: PromptBatch, keys: torch.Tensor, params: SamplingParams, batch_size: int, progress=False):
        """As HFEngine.generate, with at most the rows whose static cache fits the free memory per call
        (in equal parts): a validation of every item at once beside a segment's training state."""
        rows = min(batch_size, len(prompts))
        width, self._own = prompts.input_ids.shape[1], self.own_weights
        self._prompt_room = max(width, self.widest_prompt) if _attends_own_keys(self.model) else width
        fit = self._rows_that_fit(self._prompt_room, params.max_tokens, self._own)
        if self._prompt_room > width and fit < rows:  # room for longer prompts only where every row fits with it
            self._prompt_room = width
            fit = self._rows_that_fit(width, params.max_tokens, self._own)
        if self._own and fit < rows:  # the copy only where every row fits beside it (it pays off across calls)
            self._own = False
            fit = self._rows_that_fit(width, params.max_tokens, False)
            log.info("static engine: the decoder reads the gathered weights where they are (%d rows do not fit "
                     "beside a copy of them); its step is captured for each call", rows)
        if fit < rows:
            rows = math.ceil(rows / math.ceil(rows / fit))
            log.info("static engine: %d rows per call (%d rows' cache does not fit the free memory)", rows, min(batch_size, len(prompts)))
        return super().generate(prompts, keys, params, rows, progress)

    def _rows_that_fit(self, prompt_width: int, max_tokens: int, own: bool) -> int:
        """Rows a decoder may hold in the memory free now (its cache, output buffers and sampling
        work space), beside the prefill's working set and its weights (own: with its own copy)."""
        free = free_bytes(self.model.device)
        if free is None:
            return 1 << 62
        if self._decoder is not None:  # freed before a new decoder is made
            free += self._decoder.k.nbytes + self._decoder.v.nbytes + self._decoder.weight_bytes
        free -= _weight_bytes(self.model, own)
        text = models.text_model(self.model).config
        dtype, vocab = self.model.dtype, self.model.lm_head.weight.shape[0]
        per_row = models.kv_cache_bytes(text, dtype, 1, _cache_width(prompt_width, max_tokens)) + 4 * vocab * 4 + max_tokens * 16
        # the prefill's prefix cache and activations
        prefill = models.kv_cache_bytes(text, dtype, 1, PREFILL_TOKENS) + PREFILL_TOKENS * 24 * text.hidden_size * dtype.itemsize
        return max(1, (free - prefill) // per_row)

    @property
    def own_weights(self) -> bool:
        """Whether decoders keep their own copy of the weights their step reads (where a call's rows fit
        beside it): where the model is sharded (FSDP2 gathers it afresh for each rollout, to new places)."""
        return distributed.is_sharded(self.model)

    def _weight_addresses(self) -> tuple[int, ...]:
        """Where the decode step reads its weights. A captured graph reads them there; weights moved
        since (a parameter's data replaced) need a new capture."""
        return tuple(p.data_ptr() for p in models.text_model(self.model).parameters()) + (self.model.lm_head.weight.data_ptr(),)

    def _decoder_for(self, rows: int, width: int, params: SamplingParams) -> _Decoder:
        """The decoder for `rows` rows and a cache `width` wide (or wider, where its step attends each
        row's own keys), with the model's current weights loaded in it (copied once a call: a new
        decoder's capture reads them)."""
        own = self._own
        key = (rows, params, None if own else self._weight_addresses())
        if key == self._key and self._decoder.serves(width):
            self._decoder.load_weights()
            return self._decoder
        self._decoder = self._key = None  # free the old cache and weight copies before allocating new ones
        device = self.model.device
        eos = torch.tensor(self.eos_ids, device=device)
        banned = self.banned.to(device)
        if params.ignore_eos:  # as the hf engine (generate's min_new_tokens): EOS is never sampled
            banned = banned.index_fill(0, eos, True)
        decoder = _Decoder(self.model, rows, width, params.max_tokens, params, banned, eos, self.pad_id, own)
        decoder.load_weights()
        self.decoders += 1
        captured = self.cuda_graph and params.max_tokens > 1
        if captured:
            decoder.capture()
            self.captures += 1
        log.info("static engine: decoder %d for %d rows, a cache %d wide%s%s", self.decoders, rows, width,
                 f", its own copy of the weights ({sum(t.nbytes for t in decoder.own.values()) / 2**30:.2f} GiB: "
                 "the model is sharded)" if own else "", f"; decode step captured ({self.captures} captures)" if captured else "")
        self._decoder, self._key = decoder, key
        return decoder

    def _prefill(self, sub: PromptBatch, dec: _Decoder) -> torch.Tensor:
        """Encode each distinct prompt once into the decoder's cache; returns (rows, V) last logits.

        Distinct prompts go through the model shortest first, in forwards of at most PREFILL_TOKENS
        padded tokens, each forward padded only to its own longest prompt (not to the batch's).
        """
        first, source = prompt_runs(sub)
        source = source.to(sub.input_ids.device)
        host = replace(sub, pixel_values=None, pixel_values_videos=None).to("cpu")  # for the rope and vision indices (policy.multimodal_index)
        width = sub.input_ids.shape[1]
        lengths = host.attention_mask[first].sum(-1).tolist()
        order = sorted(range(len(first)), key=lambda u: lengths[u])  # stable: equal lengths keep their order
        chunks, current = [], []
        for u in order:  # ascending lengths: a chunk's cost is its size times its last prompt's length
            if current and (len(current) + 1) * lengths[u] > PREFILL_TOKENS:
                chunks.append(current)
                current = []
            current.append(u)
        chunks.append(current)
        logits = None
        for chunk in chunks:
            rows_of_chunk = [first[u] for u in chunk]
            pre = prefix_forward(self.model, sub.select(rows_of_chunk), host.select(rows_of_chunk))
            local_of = torch.full((len(first),), -1, dtype=torch.long, device=source.device)
            local_of[torch.tensor(chunk, device=source.device)] = torch.arange(len(chunk), device=source.device)
            rows = (local_of[source] >= 0).nonzero().squeeze(1)
            local = local_of[source[rows]]
            cols = slice(width - pre.attention_mask.shape[1], width)  # right-aligned: the last prompt token at width - 1
            for i in range(len(dec.layers)):
                dec.k[i, rows, :, cols] = pre.cache.layers[i].keys.index_select(0, local)
                dec.v[i, rows, :, cols] = pre.cache.layers[i].values.index_select(0, local)
            dec.mask[rows, cols] = pre.attention_mask.bool().index_select(0, local)
            dec.position[rows] = pre.next_position.index_select(0, local)
            last = self.model.lm_head(pre.last_hidden).index_select(0, local)
            logits = last.new_empty(len(source), last.shape[-1]) if logits is None else logits
            logits[rows] = last
        return logits

    def _generate(self, sub: PromptBatch, keys, params: SamplingParams, progress):
        rows, width = sub.input_ids.shape
        cache_width = _cache_width(max(width, self._prompt_room), params.max_tokens)
        dec = self._decoder_for(rows, cache_width, params)
        dec.mask.zero_()
        with torch.profiler.record_function("prefill"):  # a range the benchmark's validation profile reports (bench.EVAL_PHASES)
            logits = self._prefill(sub, dec)
        tokens, logp = keyed_sample(logits, keys, 0, params.temperature, params.top_p, dec.banned, params.top_k)
        dec.keys.copy_(keys)
        dec.tokens.copy_(tokens)
        dec.prompt_width.fill_(width)
        if dec.own_keys:
            dec.count_prompt_keys()
        dec.step_index.zero_()
        dec.out_tokens.fill_(self.pad_id)
        dec.out_tokens[:, 0] = tokens
        dec.out_logp.zero_()
        dec.out_logp[:, 0] = logp
        dec.finished.copy_(torch.isin(tokens, dec.eos))
        with tqdm(total=params.max_tokens, desc="generate", leave=False, disable=not progress) as bar, \
                torch.profiler.record_function("decode"):
            bar.update(1)
            dec.run(params.max_tokens - 1, stop_at_eos=not params.ignore_eos, progress=bar)
        return dec.out_tokens.clone(), dec.out_logp.clone()
