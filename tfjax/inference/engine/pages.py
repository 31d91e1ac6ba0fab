"""The engine's page pool on the host: which pages are free, who holds each, and the
full pages of prompts kept for reuse.

Pages are numbered 1..P-1 (page 0 is never handed out: the tables of rows without a
page point there). A page's reference count is the number of sequences whose table
holds it; a sequence never writes into a page another one holds (the engine copies it
first: copy on write). With prefix sharing, each full page of a prompt is registered
under the hash of all the tokens up to its end (a chain, as vLLM's automatic prefix
cache): a later prompt that starts with the same tokens takes those pages instead of
computing them. A registered page whose count falls to 0 stays cached until a free page
is needed (least recently used first). See docs/inference.md ("The engine").
"""

from __future__ import annotations

import collections
import functools
import hashlib

import jax
import numpy as np

__all__ = ["PagePool", "chain_hashes", "page_bytes"]


def chain_hashes(tokens, page_size: int, parent: bytes = b"") -> list[bytes]:
    """The hash of each full page of `tokens`: page j's covers every token up to its end."""
    out, h = [], parent
    for j in range(len(tokens) // page_size):
        block = np.asarray(tokens[j * page_size:(j + 1) * page_size], np.int64).tobytes()
        h = hashlib.blake2b(h + block, digest_size=16).digest()
        out.append(h)
    return out


class PagePool:
    """Reference-counted pages 1..`num_pages` - 1 of one cache geometry."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is reserved), got "
                             f"{num_pages}")
        self.num_pages = num_pages
        self.refs = np.zeros(num_pages, np.int32)
        self._free = collections.deque(range(1, num_pages))
        self._cached: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU
        self._hash_of: dict[int, bytes] = {}

    @property
    def available(self) -> int:
        """Pages that can be handed out now (free, or cached and unheld)."""
        return len(self._free) + sum(1 for p in self._cached.values() if self.refs[p] == 0)

    @property
    def held(self) -> int:
        """Pages some sequence holds."""
        return int(np.count_nonzero(self.refs))

    def allocate(self) -> int:
        """A page for one sequence (count 1): a free one, else the least recently used
        cached page no one holds. Raises when every page is held."""
        if self._free:
            page = self._free.popleft()
        else:
            page = next((p for p in self._cached.values() if self.refs[p] == 0), None)
            if page is None:
                raise RuntimeError("page pool exhausted: every page is held")
            del self._cached[self._hash_of.pop(page)]
        self.refs[page] = 1
        return page

    def retain(self, page: int) -> int:
        """One more holder of `page` (shared by a fork or a prefix)."""
        self.refs[page] += 1
        return page

    def release(self, pages) -> None:
        """Each of `pages` loses one holder; an unregistered page left unheld is free."""
        for page in pages:
            if self.refs[page] <= 0:
                raise RuntimeError(f"page {page} released more often than held")
            self.refs[page] -= 1
            if self.refs[page] == 0 and page not in self._hash_of:
                self._free.append(page)

    def register(self, key: bytes, page: int) -> None:
        """Keep full `page` for reuse by prompts whose tokens hash to `key`."""
        if key in self._cached or page in self._hash_of:
            return
        self._cached[key] = page
        self._hash_of[page] = key

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest run of `keys` from the start, each retained."""
        pages = []
        for key in keys:
            page = self._cached.get(key)
            if page is None:
                break
            self._cached.move_to_end(key)
            pages.append(self.retain(page))
        return pages

    def clear_cache(self) -> None:
        """Forget every cached page (unheld ones become free)."""
        for page in list(self._hash_of):
            del self._hash_of[page]
            if self.refs[page] == 0:
                self._free.append(page)
        self._cached.clear()


def page_bytes(model, max_len: int, page_size: int, chunk: int, dtype=None) -> int:
    """Bytes of one global page of `model`'s paged cache summed over the layers (from
    the cache's shapes, none made)."""
    geometries = model.page_geometries(max_len, page_size=page_size, chunk=chunk)
    size = -(-max_len // page_size) * page_size  # the global geometry's
    probe = {s: 1 + (s == size) + n for s, n in geometries.items()}
    one, two = (jax.eval_shape(functools.partial(
        model.init_paged_cache, 1, max_len, page_size=page_size, chunk=chunk,
        num_pages={**probe, size: probe[size] + k}, dtype=dtype)) for k in (0, 1))
    total = lambda c: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(c.layers))  # noqa
    return max(1, total(two) - total(one))
