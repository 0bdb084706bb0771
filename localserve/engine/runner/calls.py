"""How one StepPlan's rows go to llama_decode: in one call, or in two when that is cheaper.

Why two. On the CPU, llama.cpp computes flash attention for a batch of 64 rows or more in
tiles of 64 query rows (ggml-cpu `GGML_FA_TILE_Q`), and skips a tile of cache cells only when
every row of the query tile is masked from it. A prompt chunk's rows see only their own
sequence, so its tiles skip the other sequences' cells. A step that puts one decode row of each
other stream in the same batch makes a tile whose rows, between them, see every sequence: that
tile computes the pool's whole span (thousands of cells), and costs several times a prompt tile.
With 256-token steps that is one such tile per step. Measured on this project's model, with
three 1,100-token streams decoding beside a fourth's 1,100-token prompt in 256-token steps:
6.46 s in mixed steps, 4.96 s with each step's prompt rows in one call and the rows that need
logits in a second (medians of 4 rounds; one 1,100-token call, llama-server's way, 5.56 s).
The second call is small (under 64 rows): attention there is computed per row, over that
row's own cells only.

Rows that need no logits (prompt tokens before a chunk's last) go first, so every row that is
sampled is in the last call and its logits are still in the context when sampling reads them.

The same skipping is why the pool is compacted before a new prompt is computed. llama.cpp puts
a batch's tokens in the first free cells from where it last wrote, so a long-running pool
scatters each sequence over cells between the others' (a decode row a step for each stream,
prompts restored into the holes that trimmed drafts and cut prefixes leave). A prompt tile then
meets its own sequence in many more cell tiles: the doc workload's sequences touched 115, 151
and 201 tiles of 64 cells in a server's first, second and third run, where 70 would hold them,
and its prompt rows cost 4.35, 4.75 and 5.62 ms each. Compacting writes every sequence back in
a row (its state out, the pool cleared, the states in): about 85 ms for 4,400 cells here.
Only rows written by calls that carry several sequences scatter them (a call of one
sequence's rows fills the cells after its own, or holes that such calls left), so the pool is
compacted only once those rows fill a tile: one stream alone, as in copying at concurrency 1,
never pays for it.

Both apply only where the model runs on the CPU (no layer offloaded): they answer the CPU
kernel's tiling, and with offload neither the second call nor copying every sequence out of
VRAM and back was measured (no GPU has run this project). Neither applies with a cache stream
per slot (--no-kv-unified): each sequence's rows attend over its own stream's cells only.
"""

from __future__ import annotations

from localserve.engine.plan import SeqChunk, StepPlan

QUERY_TILE_ROWS = 64  # ggml-cpu's flash-attention query tile (a batch this large is tiled)

Span = tuple[SeqChunk, int, int]  # a chunk's tokens[start:end] in one call


def compacts(plan: StepPlan, interleaved_rows: int) -> bool:
    """Compact the pool before this step: it starts computing a new prompt of a query tile or
    more, whose cells then follow one another after the compacted sequences, and a tile's
    worth of rows has been written interleaved with other sequences' since the last time."""
    if interleaved_rows < QUERY_TILE_ROWS:
        return False
    admitted = {a.slot_id for a in plan.admitted}
    return any(c.slot_id in admitted and len(c.tokens) >= QUERY_TILE_ROWS for c in plan.chunks)


def interleaved(call: list[Span]) -> int:
    """The rows a call writes between other sequences' (all of them, when it carries more
    than one sequence)."""
    if len({chunk.slot_id for chunk, _, _ in call}) < 2:
        return 0
    return sum(end - start for _, start, end in call)


def one_call(plan: StepPlan) -> list[list[Span]]:
    return [[(chunk, 0, len(chunk.tokens)) for chunk in plan.chunks]]


def stream_call(plan: StepPlan) -> list[list[Span]]:
    """One call, its sequences in slot order: with a cache stream per slot, llama.cpp splits
    a batch into ubatches of sequences whose ids follow one another (llama_batch_allocr's
    split_equal), so slot order makes the fewest."""
    return [[(chunk, 0, len(chunk.tokens)) for chunk in sorted(plan.chunks,
                                                                key=lambda c: c.slot_id)]]


def decode_calls(plan: StepPlan) -> list[list[Span]]:
    """The plan's rows as one call, or as two: the prompt rows that need no logits, then the
    rest, when the first has a whole query tile and the second serves another sequence."""
    bulk: list[Span] = []
    sampled: list[Span] = []
    for chunk in plan.chunks:
        cut = len(chunk.tokens) - 1 - chunk.drafts if chunk.sample else len(chunk.tokens)
        if cut > 0:
            bulk.append((chunk, 0, cut))
        if cut < len(chunk.tokens):
            sampled.append((chunk, cut, len(chunk.tokens)))
    bulk_rows = sum(end - start for _, start, end in bulk)
    others = {c.slot_id for c, _, _ in sampled} - {c.slot_id for c, _, _ in bulk}
    if bulk_rows < QUERY_TILE_ROWS or not others:
        return one_call(plan)
    return [bulk, sampled]
