"""The inference engine: continuous batching over a paged KV cache.

    engine = Engine(model, EngineConfig(max_seqs=16, page_size=16, chunk=64),
                    eos_ids=(eos,), decode=tokenizer.decode)
    engine.submit(Request(prompt, max_tokens=64, n=4, sampling=dict(temperature=0.8)))
    while engine.has_work(): outputs = engine.step()     # [Output]: a token of a sample

A step is one ragged call: prompt runs and every decoding row's token as one token list
(weights read once), read once the next step's call is dispatched (a row's next input
stays on the device); a state per row makes a call of each kind. Few shapes (`warm_up`).
Admission reserves pages for the longest answer (no preemption); a stopped sample frees
its pages at once. Serve unrolled layers (`tfjax.models.unrolled`). See docs/inference.md."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.inference.cache import has_row_states, reads_runs
from tfjax.inference.engine.pages import PagePool, chain_hashes, page_bytes
from tfjax.inference.engine.programs import padded_pairs, programs, state_shardings
from tfjax.inference.engine.requests import Output, Placeholder, Request, SequenceState
from tfjax.inference.sampling import SamplingParams
from tfjax.parallel.sharding import use_rules

__all__ = ["Engine", "EngineConfig"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """max_seqs: rows of every step (sequences decoded at once). max_len: tokens of a
    sequence, prompt and answer (0: the model's `max_len`). page_size: tokens per page.
    chunk: prompt tokens a row prefills per step. num_pages: pages of the global K/V
    pools (0: from `kv_memory` bytes, or 0 too: enough for every row's `max_len`).
    prefix_caching: prompts reuse the full pages of earlier prompts they start with
    (models whose every cached layer keeps global K/V). max_logprobs: the most top
    log-probabilities a request may ask for. prefill_rows: the most rows that prefill a
    chunk in one step (at most max_seqs; the chunk call runs over 1, 2, 4 .. of them);
    decoding rows run apart, one token each, so a prompt costs its own chunk, not every
    row's. table_widths: the page-table widths of the global K/V each step shape is
    compiled for (the whole table and its halvings, this many at most): a call's rows
    attend over the narrowest that holds their pages (1: always the whole table).
    chunk_sizes: the chunk call's token widths (`chunk` and its halvings, this many at
    most): a call runs the narrowest that holds its rows' next tokens, so a prompt's last
    piece computes less padding (1: always `chunk`; the pieces are the same either way).
    ragged: a step with both kinds of rows is one call (`programs.ragged`), where every
    layer keeps pages, K/V or latents (`cache.reads_runs`), and no prompt is scored;
    else a call for each kind."""

    max_seqs: int = 8
    max_len: int = 0
    page_size: int = 16
    chunk: int = 32
    num_pages: int = 0
    kv_memory: int = 0
    dtype: str | None = None
    prefix_caching: bool = True
    max_logprobs: int = 20
    prefill_rows: int = 4
    table_widths: int = 3
    chunk_sizes: int = 1
    ragged: bool = True

    def check(self):
        for name in ("max_seqs", "page_size", "chunk", "prefill_rows", "table_widths",
                     "chunk_sizes"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name}: must be >= 1, got {getattr(self, name)}")


class Engine:
    """Continuous batching of `Request`s on a decoder-only `model` (see the module)."""

    def __init__(self, model, config: EngineConfig = EngineConfig(), *, eos_ids=(),
                 decode=None, mesh=None, rules=None):
        """`eos_ids` end a sample (unless its request ignores them); `decode` (token ids ->
        text) lets requests stop at strings; `mesh` and `rules` (`use_rules`): the
        programs are traced under them, the model's parameters placed by the caller."""
        config.check()
        self.mesh, self.rules = mesh, rules
        cfg = model.config
        if getattr(cfg, "arch", "decoder") != "decoder":
            raise ValueError(f"the inference engine serves decoder-only models; this one is "
                             f"model.arch={cfg.arch!r} (use tfjax.inference.generate)")
        self.config = config
        self.max_len = config.max_len or cfg.max_len
        self.vocab_size = cfg.vocab_size
        self.eos_ids, self.decode = frozenset(int(e) for e in eos_ids), decode
        B, ps, C = config.max_seqs, config.page_size, config.chunk
        model.eval()
        self.graphdef, self.params = nnx.split(model)
        geometries = model.page_geometries(self.max_len, page_size=ps, chunk=C)
        self.global_size = -(-self.max_len // ps) * ps
        self.rings = {s: n for s, n in geometries.items() if s != self.global_size}
        num_pages = {s: 1 + B * n for s, n in self.rings.items()}
        if self.global_size in geometries:
            num_pages[self.global_size] = self._global_pages(model, num_pages)
        self.pools = {s: PagePool(n) for s, n in num_pages.items()}
        self.num_pages = num_pages
        self.tables = {s: np.zeros((B, n), np.int32) for s, n in geometries.items()}
        for s, n in self.rings.items():  # a ring's pages are its row's for good
            self.tables[s][:] = 1 + np.arange(B * n, dtype=np.int32).reshape(B, n)
        cache = model.init_paged_cache(B, self.max_len, page_size=ps, chunk=C,
                                       num_pages=num_pages, dtype=config.dtype)
        self.cache = cache
        self.shareable = (config.prefix_caching and not self.rings
                          and not has_row_states(cache))
        self._ragged = config.ragged and reads_runs(cache)
        self.seen = jnp.zeros((B, self.vocab_size), bool)
        self.counts = jnp.zeros((B, self.vocab_size), jnp.int32)
        self.last = jnp.zeros(B, jnp.int32)  # each row's last drawn token (programs.drawn)
        self._in_flight = []  # the calls dispatched by the last step, read by the next
        self.slots: list[SequenceState | None] = [None] * B
        self.waiting: collections.deque[tuple[Request, dict]] = collections.deque()
        self._inbox: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._programs = programs(self.graphdef, mesh)
        if mesh is not None:  # placed as every program returns them (`programs.placed`)
            self.cache, self.seen, self.counts, self.last = jax.device_put(
                (self.cache, self.seen, self.counts, self.last),
                state_shardings(self.cache, mesh, dict(rules or ())))
        self._chunks = sorted({-(-C // 2 ** i) for i in range(config.chunk_sizes)})
        self._row_counts = {  # the rows of each call of T tokens: 1, 2, 4 .. up to a limit
            T: sorted({1 << i for i in range(most.bit_length()) if 1 << i < most} | {most})
            for T, most in [(t, min(config.prefill_rows, B)) for t in self._chunks] + [(1, B)]}
        self._widths = sorted({-(-geometries.get(self.global_size, 0) // 2 ** i)  # pages read
                               for i in range(config.table_widths)})
        self._last_sampling = (None, None, None)
        self._tables_on_device = None

    # ------------------------------------------------------------------ sizes
    def _global_pages(self, model, ring_pages: dict) -> int:
        """The global pools' page count: `num_pages`, else what `kv_memory` holds, else
        every row's `max_len`; never equal to a ring's (pools are told apart by it)."""
        c, per_row = self.config, self.global_size // self.config.page_size
        if c.num_pages:
            n = c.num_pages
        elif c.kv_memory:
            n = int(c.kv_memory // self.page_bytes(model))
        else:
            n = 1 + c.max_seqs * per_row
        if n < 1 + per_row:
            raise ValueError(f"EngineConfig: {n} global pages cannot hold one sequence of "
                             f"max_len={self.max_len} ({per_row} pages of {c.page_size} and "
                             f"page 0); raise num_pages or kv_memory, or lower max_len")
        while n in ring_pages.values():
            n += 1
        return n

    def page_bytes(self, model) -> int:
        """Bytes of one global page summed over the layers (`pages.page_bytes`)."""
        c = self.config
        return page_bytes(model, self.max_len, c.page_size, c.chunk, c.dtype)

    # --------------------------------------------------------------- requests
    def submit(self, request: Request) -> str:
        """Queue `request` (thread-safe); a bad one raises a one-line ValueError now."""
        settings = request.check(max_len=self.max_len, vocab_size=self.vocab_size,
                                 max_logprobs=self.config.max_logprobs)
        if request.n > self.config.max_seqs:
            raise ValueError(f"n: {request.n} samples exceed the engine's max_seqs="
                             f"{self.config.max_seqs} (request {request.request_id})")
        pool = self.pools.get(self.global_size)
        worst = request.pages_needed(self.config.page_size, self.max_len)[-1]
        if pool is not None and worst > pool.num_pages - 1:
            raise ValueError(f"max_tokens: {request.n} sample(s) of up to "
                             f"{min(len(request.prompt) + request.max_tokens, self.max_len)} "
                             f"tokens need {worst} pages, the pool has {pool.num_pages - 1}; "
                             f"lower max_tokens or n (request {request.request_id})")
        with self._lock:
            self._inbox.append(("submit", request, settings))
        return request.request_id

    def cancel(self, request_id: str) -> None:
        """Stop `request_id` (thread-safe): its pages are freed at the next step."""
        with self._lock:
            self._inbox.append(("cancel", request_id, None))

    def has_work(self) -> bool:
        return bool(self._inbox or self.waiting or any(self.slots) or self._in_flight)

    def queued(self) -> int:
        """Requests submitted and not admitted yet (thread-safe): what a server bounds."""
        with self._lock:
            return sum(c[0] == "submit" for c in self._inbox) + len(self.waiting)

    def _drain(self) -> list[Output]:
        out = []
        with self._lock:  # held throughout, so that `queued` never misses a request
            commands = list(self._inbox)
            self._inbox.clear()
            for kind, what, settings in commands:
                if kind == "submit":
                    self.waiting.append((what, settings))
                    continue
                before = len(self.waiting)
                self.waiting = collections.deque(w for w in self.waiting
                                                 if w[0].request_id != what)
                if len(self.waiting) < before:
                    continue
                for seq in [s for s in self.slots  # a leader frees its unforked followers
                            if isinstance(s, SequenceState) and s.request.request_id == what]:
                    out.append(Output(what, seq.index, None, finish_reason="abort"))
                    self._free(seq)
        return out

    # --------------------------------------------------------------- admission
    def _committed(self) -> int:
        return sum(s.worst - len(s.pages) for s in self.slots if s is not None)

    def _admit(self) -> None:
        """Admit waiting requests in order while slots and pages last."""
        while self.waiting:
            request, settings = self.waiting[0]
            free = [b for b, s in enumerate(self.slots) if s is None]
            if len(free) < request.n:
                return
            ps, L = self.config.page_size, len(request.prompt)
            target, per_seq, shared, worst = request.pages_needed(ps, self.max_len)
            pool = self.pools.get(self.global_size)
            hashes, cached = [], []
            if self.shareable and pool is not None:  # (scored positions are computed)
                hashes = chain_hashes(request.prompt[:L - 1 if not request.score_from
                                                     else request.score_from - 1], ps)
                cached = pool.lookup(hashes)
            if pool is not None and pool.available < self._committed() + worst - len(cached):
                pool.release(cached)
                if not any(self.slots):
                    raise RuntimeError(f"request {request.request_id} needs {worst} pages; the "
                                       f"pool has {pool.num_pages - 1}")
                return
            self.waiting.popleft()
            leader = SequenceState(request, 0, free[0], settings, list(request.prompt), L,
                                   target, computed=len(cached) * ps, pages=list(cached),
                                   worst=per_seq, registered=len(cached), hashes=hashes)
            leader.followers = free[1:request.n]
            for b in free[:request.n]:
                self.slots[b] = (leader if b == leader.slot
                                 else Placeholder(leader, per_seq - shared))

    # -------------------------------------------------------------------- step
    def step(self) -> list[Output]:
        """One engine step: take new requests and cancellations, admit, dispatch a call
        running up to `prefill_rows` prefilling rows a chunk further and every decoding
        row one token (or a call of each kind), then read the calls the step before
        dispatched (their tokens: a decoding row's next input stays on the device, so
        the host's work overlaps the device's) and return them."""
        out = self._drain()
        self._admit()
        self._fork_ready()
        rows = [s for s in self.slots if isinstance(s, SequenceState)]
        if any(s.fresh for s in rows):
            self._reset(rows)
        prefilling = [s for s in rows if s.computed < s.target]
        decoding = [s for s in rows if s.computed >= s.target and not s.spent(self.max_len)]
        calls = []
        if prefilling:
            group = prefilling[:self._row_counts[self.config.chunk][-1]]
            longest = max(min(self.config.chunk, s.target - s.computed) for s in group)
            T = next(t for t in self._chunks if t >= longest)
            if self._ragged and not any(s.request.score_from for s in prefilling):
                calls.append(self._launch_ragged(prefilling, T, decoding))
                decoding = []
            else:
                calls.append(self._launch(group, T))
        if decoding:
            calls.append(self._launch(decoding, 1))
        done, self._in_flight = self._in_flight, calls
        return out + [o for call in done for o in self._finish(*call)]

    def _take(self, s: SequenceState, T: int) -> tuple[int, bool]:
        """The tokens `s` takes in a call of T (its prompt's next piece, else its last
        token; its pages grown to hold them) and whether the call samples after them."""
        n = min(T, s.target - s.computed) if s.computed < s.target else 1
        self._grow(s, s.computed + n)
        sample = s.computed + n >= s.target and not s.followers and s.request.max_tokens > 0
        s.dispatched, s.unread = s.dispatched + sample, s.unread + 1
        return n, sample

    def _launch_ragged(self, prefilling: list[SequenceState], C: int,
                       decoding: list[SequenceState]):
        """Dispatch the ragged call (`programs.ragged`): prompt tokens as runs of C, up to
        `_row_counts[C]`'s most runs, the first prefilling rows taking as many as their
        prompts fill (spare runs padding), then one token for each row (`decoding`'s
        last; padding for the others); sampled: each row's last run, then the rows. As
        `_launch` returns."""
        B, left, taken = self.config.max_seqs, self._row_counts[C][-1], []
        for s in prefilling[:left]:  # (row, runs it takes) while runs are left; one with
            k = -(-(s.target - s.computed) // C)  # rings (they hold one chunk past windows)
            taken.append((s, min(1 if self.rings else k, left)))
            left -= taken[-1][1]
            if not left:
                break
        group = [s for s, _ in taken]
        runs = [s.slot for s, k in taken for _ in range(k)]
        R = next(r for r in self._row_counts[C] if r >= len(runs))
        spare = [b for b in range(B) if b not in runs] or runs  # (spare runs: other rows)
        pick_slots = np.asarray(runs + (spare * R)[:R - len(runs)] + list(range(B)), np.int32)
        tokens, valid = np.zeros(R * C + B, np.int32), np.zeros(R * C + B, bool)
        idle = [getattr(held, "computed", 0) for held in self.slots]  # a row's padding token
        position = np.asarray([0] * (R * C) + idle, np.int32)  # sits at its row's length
        slot_of = np.concatenate([np.repeat(pick_slots[:R], C), np.arange(B)]).astype(np.int32)
        picks = np.concatenate([np.arange(R) * C, R * C + np.arange(B)]).astype(np.int32)
        after, samples = np.zeros(R + B, np.int32), np.zeros(R + B, bool)
        where, feed, start = {}, {}, 0
        for s, k in taken:
            n, sample = self._take(s, k * C)
            i = where[s.slot] = start // C + k - 1  # its last run
            tokens[start:start + n] = s.tokens[s.computed:s.computed + n]
            valid[start:start + n] = True
            position[start:start + k * C] = s.computed + np.arange(k * C)
            picks[i], after[i], samples[i], feed[s.slot] = start + n - 1, s.computed + n, sample, n
            start += k * C
        for s in decoding:
            j, (n, samples[R + s.slot]) = R * C + s.slot, self._take(s, 1)
            where[s.slot], feed[s.slot] = R + s.slot, n
            tokens[j], valid[j], after[R + s.slot] = s.next_token(), True, s.computed + 1
        group = group + decoding
        num_logprobs = self.config.max_logprobs if any(s.request.logprobs for s in group) else 0
        held = -(-max(s.computed + feed[s.slot] for s in group) // self.config.page_size)
        with self._traced():
            sampled, self.cache, self.counts, self.last = self._programs.ragged(
                R, C, num_logprobs, self._narrow(held))(
                self.params, self.cache, self.seen, self.counts, self.last, tokens, slot_of,
                position, valid, self._device_tables(), self._sampling(pick_slots.tolist()),
                picks, pick_slots, after, samples)
        for s in group:
            s.computed += feed[s.slot]
            self._register(s)
        return group, where, samples, None, sampled, None

    def _launch(self, group: list[SequenceState], T: int) -> tuple:
        """Dispatch one jitted call: each sequence of `group` takes its next tokens (up to
        T: the prompt's next chunk, else its last token), over the fewest rows of
        `_row_counts[T]` that hold `group`, padded with other rows that idle (all
        `max_seqs` rows: the cache as it is, no rows gathered). The tokens count as
        cached at once; `_finish` reads what the call samples."""
        B = self.config.max_seqs
        R = next(r for r in self._row_counts[T] if r >= len(group))
        if R == B:
            slots = list(range(B))
            where = {s.slot: s.slot for s in group}
        else:
            taken = {s.slot for s in group}
            slots = [s.slot for s in group] + [b for b in range(B) if b not in taken]
            slots = slots[:R]
            where = {s.slot: i for i, s in enumerate(group)}
        tokens = np.zeros((R, T), np.int32)
        n_new = np.zeros(R, np.int32)
        length = np.zeros(R, np.int32)
        samples = np.zeros(R, bool)
        targets = np.full((R, T), -1, np.int32)  # the prompt tokens to score, per position
        feed = {}
        for s in group:
            i = where[s.slot]
            n, samples[i] = self._take(s, T)
            feed[s.slot] = n
            tokens[i, :n] = s.tokens[s.computed:s.computed + n] if n > 1 else s.next_token()
            n_new[i], length[i] = n, s.computed
            if s.request.score_from and s.computed < s.prompt_len:
                for t in range(n):
                    p = s.computed + t + 1
                    if s.request.score_from <= p < s.prompt_len:
                        targets[i, t] = s.tokens[p]
        for i, b in enumerate(slots):  # idle rows keep their length (nothing is written)
            if b not in where and isinstance(self.slots[b], SequenceState):
                length[i] = self.slots[b].computed
        num_logprobs = self.config.max_logprobs if any(s.request.logprobs for s in group) else 0
        score = bool((targets >= 0).any())
        rows = None if R == B else np.asarray(slots, np.int32)
        held = -(-max(s.computed + feed[s.slot] for s in group) // self.config.page_size)
        with self._traced():
            sampled, scored, self.cache, self.counts, self.last = self._programs.step(
                T, R if R < B else 0, num_logprobs, score, self._narrow(held))(
                self.params, self.cache, self.seen, self.counts, self.last, rows, tokens, n_new,
                length, self._device_tables(), self._sampling(slots), length + n_new, samples,
                targets)
        for s in group:
            s.computed += feed[s.slot]
            self._register(s)
        return group, where, samples, targets if score else None, sampled, scored

    def _finish(self, group, where, samples, targets, sampled, scored) -> list[Output]:
        """Wait for a `_launch`ed call; take its samples and scores (`targets` given)."""
        sampled, scored = jax.device_get((sampled, scored))
        out = []
        for s in group:
            s.unread -= 1
        for s in [s for s in group if self.slots[s.slot] is s]:  # (not stopped since)
            i = where[s.slot]
            if targets is not None:
                s.scores += [(float(scored[0][i, t]), bool(scored[1][i, t]))
                             for t in range(targets.shape[1]) if targets[i, t] >= 0]
            if samples[i]:
                out.append(s.output(sampled, i, self.eos_ids, self.decode, self.max_len))
                if out[-1].finish_reason is not None:
                    self._free(s)
            elif s.request.max_tokens == 0 and s.computed >= s.target and not s.unread:
                out.append(s.scored(Output(s.request.request_id, 0, None,
                                           finish_reason="length")))
                self._free(s)
        return out

    def _narrow(self, held: int) -> tuple:
        """The `narrow` of a call whose rows hold up to `held` global pages: the
        narrowest width of `_widths` that covers them (none: the whole table)."""
        width = next(w for w in self._widths if w >= held or w == self._widths[-1])
        return ((self.global_size, width),) if width < self._widths[-1] else ()

    def _traced(self):
        """The context the programs run in: the mesh's rules, if any."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return use_rules(self.mesh, self.rules)

    def _sampling(self, slots: list[int]) -> SamplingParams:
        """The sampling settings of the sequences in `slots`, row by row (built once for
        each set of sequences: a decode step's is the last one's)."""
        settings = [getattr(self.slots[b], "settings", None) for b in slots]
        key = tuple(map(id, settings))
        if self._last_sampling[0] != key:  # (the settings are kept: their ids stay theirs)
            self._last_sampling = (key, settings, jax.device_put(SamplingParams.of(settings)))
        return self._last_sampling[2]

    def _device_tables(self) -> dict:
        """The page tables on the device, sent again only after they changed: copies (a
        CPU array may share the numpy buffer, which changes while calls are in flight)."""
        if self._tables_on_device is None:
            self._tables_on_device = jax.device_put({s: t.copy() for s, t in self.tables.items()})
        return self._tables_on_device

    def _grow(self, s: SequenceState, end: int) -> None:
        """Give `s` the global pages that tokens up to `end` need."""
        pool = self.pools.get(self.global_size)
        if pool is None:
            return
        need = -(-end // self.config.page_size)
        while len(s.pages) < need:
            s.pages.append(pool.allocate())
        if need > 0 and self.tables[self.global_size][s.slot, need - 1] != s.pages[need - 1]:
            row = self.tables[self.global_size][s.slot]
            row[:] = 0
            row[:len(s.pages)] = s.pages
            self._tables_on_device = None

    def _register(self, s: SequenceState) -> None:
        """Put the full prompt pages `s` has computed into the prefix cache."""
        if not self.shareable:
            return
        pool, ps = self.pools[self.global_size], self.config.page_size
        done = min(s.computed, s.prompt_len - 1) // ps
        while s.registered < min(done, len(s.hashes)):
            pool.register(s.hashes[s.registered], s.pages[s.registered])
            s.registered += 1

    def _reset(self, rows) -> None:
        """Clear the per-row states of newly admitted rows and mark their prompts seen."""
        prompts = np.full((self.config.max_seqs, self.max_len), -1, np.int32)
        fresh = np.zeros(self.config.max_seqs, bool)
        for s in rows:
            if s.fresh:
                prompts[s.slot, :s.prompt_len] = s.tokens[:s.prompt_len]
                fresh[s.slot], s.fresh = True, False
        with self._traced():
            self.cache, self.seen, self.counts = self._programs.reset(
                self.cache, self.seen, self.counts, fresh, prompts)

    def _fork_ready(self) -> None:
        """Leaders of n > 1 samples whose prompt but its last token is in the cache get
        their followers: full pages shared, the partial page, ring pages and per-row
        state copied."""
        ps = self.config.page_size
        pairs = {s: [] for s in self.num_pages}
        row_pairs = []
        for leader in [s for s in self.slots if isinstance(s, SequenceState)]:
            if not leader.followers or leader.computed < leader.target:
                continue
            pool = self.pools.get(self.global_size)
            full = leader.computed // ps
            for i, slot in enumerate(leader.followers, start=1):
                seed = (leader.settings["seed"] + i * 0x9E3779B9) % 2**32  # its own draws
                seq = dataclasses.replace(leader, index=i, slot=slot, tokens=list(leader.tokens),
                                          settings=dict(leader.settings, seed=seed), pages=[],
                                          worst=self.slots[slot].worst, followers=[],
                                          hashes=[], registered=0, unread=0)
                if pool is not None:
                    seq.pages = [pool.retain(p) for p in leader.pages[:full]]
                    if len(leader.pages) > full:  # the partial page: a copy of its own
                        page = pool.allocate()
                        pairs[self.global_size].append((leader.pages[full], page))
                        seq.pages.append(page)
                    row = self.tables[self.global_size][slot]
                    row[:] = 0
                    row[:len(seq.pages)] = seq.pages
                    self._tables_on_device = None
                for size, n in self.rings.items():
                    pairs[size].extend(zip(self.tables[size][leader.slot],
                                           self.tables[size][slot]))
                row_pairs.append((leader.slot, slot))
                self.slots[slot] = seq
            leader.followers = []
        if row_pairs:
            with self._traced():
                self.cache, self.seen, self.counts = self._programs.fork(
                    self.cache, self.seen, self.counts, self._page_pairs(pairs),
                    padded_pairs(row_pairs, self.config.max_seqs))

    def _page_pairs(self, pairs: dict) -> dict:
        """{pool page count: (src, dst) pairs padded to a fixed count}: a ring's every
        page of every row, the global pool's one partial page a row."""
        B = self.config.max_seqs
        return {self.num_pages[s]: padded_pairs(p, B * len(self.tables[s][0]) if s in self.rings
                                           else B)
                for s, p in pairs.items()}

    # ----------------------------------------------------------------- outputs
    def _free(self, s: SequenceState) -> None:
        """Release `s`'s pages and slot (and its followers' slots, if not forked yet)."""
        pool = self.pools.get(self.global_size)
        if pool is not None:
            pool.release(s.pages)
        s.pages = []
        for slot in [s.slot] + s.followers:
            self.slots[slot] = None
            if pool is not None:
                self.tables[self.global_size][slot] = 0
                self._tables_on_device = None
        s.followers = []

    # ------------------------------------------------------------ convenience
    def warm_up(self, logprobs: bool = False, scoring: bool = False) -> None:
        """Compile every step shape now (a server's start-up), not at the first request
        that needs it: the decode step and the ragged step (else the chunk step) of each
        chunk size, row count and table width, with top log-probabilities and prompt
        scoring (the chunk step) if asked. Runs them with no tokens: the caches are left
        as they were; so are the reset of admitted rows and the fork of n samples (no
        row, page 0 onto itself)."""
        B = self.config.max_seqs
        with self._traced():
            self.cache, self.seen, self.counts = self._programs.reset(
                self.cache, self.seen, self.counts, np.zeros(B, bool),
                np.full((B, self.max_len), -1, np.int32))
            pairs = self._page_pairs({s: [] for s in self.num_pages})
            self.cache, self.seen, self.counts = self._programs.fork(
                self.cache, self.seen, self.counts, pairs, padded_pairs([], B))
        lengths = np.asarray([getattr(s, "computed", 0) for s in self.slots], np.int32)
        kinds = {T: ["step"] if T == 1 else ["ragged" if self._ragged else "step"]
                 + ["score"] * scoring for T in self._row_counts}
        shapes = [(T, r, w, k, kind) for T in self._row_counts for r in self._row_counts[T]
                  for w in self._widths for k in {0, self.config.max_logprobs * logprobs}
                  for kind in kinds[T]]
        for T, R, width, num_logprobs, kind in shapes:
            with self._traced():
                if kind == "ragged":
                    N, slots = R * T + B, np.arange(R + B, dtype=np.int32) % B
                    _, self.cache, self.counts, self.last = self._programs.ragged(
                        R, T, num_logprobs, self._narrow(width))(
                        self.params, self.cache, self.seen, self.counts, self.last,
                        np.zeros(N, np.int32), np.zeros(N, np.int32), np.zeros(N, np.int32),
                        np.zeros(N, bool),
                        self._device_tables(), self._sampling(slots.tolist()),
                        np.zeros(R + B, np.int32), slots, np.zeros(R + B, np.int32),
                        np.zeros(R + B, bool))
                    continue
                n, R = R, (R if R < B else 0)
                zeros = np.zeros((n, T), np.int32)
                _, _, self.cache, self.counts, self.last = self._programs.step(
                    T, R, num_logprobs, kind == "score", self._narrow(width))(
                    self.params, self.cache, self.seen, self.counts, self.last,
                    np.arange(n, dtype=np.int32) if R else None, zeros, np.zeros(n, np.int32),
                    lengths[:n], self._device_tables(), self._sampling(list(range(n))),
                    lengths[:n], np.zeros(n, bool), zeros - 1)

    def generate(self, requests: list[Request]) -> dict:
        """Run `requests` to the end: {request_id: [tokens of sample 0, 1, ...]}."""
        results = {r.request_id: [[] for _ in range(r.n)] for r in requests}
        for r in requests:
            self.submit(r)
        while self.has_work():
            for o in self.step():
                if o.token is not None:
                    results[o.request_id][o.index].append(o.token)
        return results

    def pages_in_use(self) -> int:
        """Global pages some sequence holds (0 when the engine is idle)."""
        pool = self.pools.get(self.global_size)
        return 0 if pool is None else pool.held
