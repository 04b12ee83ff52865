"""Writes inside inductor-compiled graphs: judged before the graph runs, at the line that wrote.

Inductor writes the inputs a graph mutates inside its own kernels: no op is dispatched,
so no write hook or dispatch mode sees them. The compiled artifact lists those inputs, so
each call of such a graph is judged as a `copy_` into each of them (what AOT autograd
makes of an input mutation) before its kernels run: under "raise" the data stays intact,
otherwise the report's before → after is read around the call.

The report's line is the write's, in the user's function: the post-grad graph's node
comment above the write, used only where the source confirms it (an FX graph cache hit
carries the text of an earlier compile of an equal graph: lines since moved, or another
file's); otherwise the compiled call's line.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import linecache
import re
import sys
import tokenize
import types
from typing import Callable, Optional, Sequence

import torch

from kvguard._engine.judge import PendingWrite, WriteJudge, judge_all, judged_as_graph_writes
from kvguard._protect import frames as _frames
from kvguard._torch import compiled as _compiled
from kvguard._torch import ops as _ops
from kvguard._torch import patches as _patches

_COPY = torch.ops.aten.copy_.default
_SITES = "_kvguard_write_sites"  # the artifact's attribute caching its input -> Site map
_listening: list[Callable[[], None]] = []  # the undo, once listening


JudgesOf = Callable[[Sequence[torch.Tensor]], dict[int, list[WriteJudge]]]  # see `choice.judges_of`


def listen(judges_of: JudgesOf) -> None:
    """From now on, judge every compiled graph's input writes (once per process): `judges_of(tensors)`
    gives, per tensor, the active judges a write into it is shown to."""
    if _listening:
        return
    _listening.append(_patches.on_compiled_graph_call(functools.partial(judge_graph, judges_of)))


def judge_graph(judges_of: JudgesOf, graph: _compiled.CompiledGraph,
                inputs: Sequence[object]) -> Optional[Callable[[bool], None]]:
    """Judge the writes `graph` will make to `inputs`, one input at a time (each at its own line);
    returns what reports them once the graph has run. Raises, before the graph runs, to stop it.

    Per call it costs one pass over the mutated inputs in C (the write hook's own test): a
    compiled optimizer step writes every parameter and its state, and stays near eager's cost."""
    positions, written = _compiled.mutated_inputs(graph, inputs)
    shown = judges_of(written) if written else {}
    if not shown:
        return None
    sites = write_sites(graph)
    facts = _ops.op_facts(_COPY)
    pending: list[PendingWrite] = []
    try:
        for i, judges in sorted(shown.items()):
            with _frames.located(functools.partial(_site, sites.get(positions[i]))):
                pending += judge_all(judges, _COPY, facts, (written[i],))
    except BaseException:
        for found in pending:  # a later input's write stopped the graph: nothing landed
            found.stopped()
        raise
    if not pending:
        return None
    undo = judged_as_graph_writes([written[i] for i in shown])

    def after(failed: bool) -> None:
        undo()
        for found in pending:
            found(failed)
    return after


def write_sites(graph: _compiled.CompiledGraph) -> dict[int, _frames.Site]:
    """Input position -> the site the graph's text names for its first write to it, as the text
    says it (cached on the artifact; `_site` confirms it when a report needs it)."""
    sites = getattr(graph, _SITES, None)
    if sites is None:
        try:
            sites = _sites_in(_compiled.compiled_graph_text(graph))
        except Exception:  # noqa: BLE001 - a graph text of another shape: the compiled call's line
            sites = {}
        try:
            setattr(graph, _SITES, sites)
        except Exception:  # noqa: BLE001 - an artifact that takes no attribute: read again next call
            pass
    return sites


def _call_site() -> _frames.Site:
    """The user's line that called the compiled code (not a line of the bytecode Dynamo wrote),
    else the innermost user frame. Never `user_site()`: inside `located` that is this site."""
    first = None
    for frame in _frames.user_frames(sys._getframe(1)):
        if not _compiled.dynamo_generated(frame.f_code):
            return _frames.site_of(frame)
        first = first or frame
    return _frames.site_of(first)


def _site(named: Optional[_frames.Site]) -> _frames.Site:
    """Where the report puts a write the graph's text names (`named`): there if the source
    confirms it, else the user's line that called the compiled code. Asked only for a write
    that hits protected memory."""
    try:
        confirmed = _confirmed(named) if named is not None else None
    except Exception:  # noqa: BLE001 - a source that cannot be read: the call's line
        confirmed = None
    return confirmed or _call_site()


def _confirmed(named: _frames.Site) -> Optional[_frames.Site]:
    """Where the code a graph's comment names is now: in a compiled function running now (the
    one line of its body holding that code), else at the named line if the file still holds it
    there (a function Dynamo inlined from elsewhere). An FX graph cache hit brings the comments
    of the first compile of an equal graph: lines since moved, or another file's."""
    code = _code_only(named.code)
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        if _compiled.dynamo_generated(frame.f_code):
            found = _line_in_function(frame.f_code, code)
            if found is not None:
                return found
        frame = frame.f_back
    if _code_only(linecache.getline(named.filename, named.lineno)) == code:
        return named._replace(code=linecache.getline(named.filename, named.lineno).strip())
    return None


def _line_in_function(code: types.CodeType, wanted: str) -> Optional[_frames.Site]:
    lines = linecache.getlines(code.co_filename)
    if not lines or code.co_firstlineno < 1:
        return None
    try:
        block = inspect.getblock(lines[code.co_firstlineno - 1:])
    except Exception:  # noqa: BLE001 - source that does not parse as a block
        return None
    hits = [i for i, line in enumerate(block) if _code_only(line) == wanted]
    if len(hits) != 1:
        return None
    lineno = code.co_firstlineno + hits[0]
    return _frames.Site(code.co_filename, lineno, code.co_name, block[hits[0]].strip())


def _code_only(line: str) -> str:
    """A source line without its trailing comment, stripped (`k *= coef  # BUG` -> `k *= coef`)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip()).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return line.strip()
    comment = next((t for t in tokens if t.type == tokenize.COMMENT), None)
    return (line.strip()[:comment.start[1]] if comment is not None else line.strip()).rstrip()


# Ops whose result shares its first argument's memory: a write through one writes the input.
_VIEWS = frozenset({"alias", "as_strided", "diagonal", "expand", "narrow", "permute", "select", "slice", "squeeze",
                    "t", "transpose", "unbind", "unfold", "unsqueeze", "view", "view_as_complex", "view_as_real",
                    "_reshape_alias", "reshape", "split", "split_with_sizes", "chunk", "movedim", "getitem"})


def _sites_in(text: str) -> dict[int, _frames.Site]:
    """Input position -> the site of the graph's first write into its memory (through views too).

    A node's site is its `# File:` comment; a write that post-grad passes made (no comment of
    its own: `copy_(select_int, add)`) has the site of the value it writes.
    """
    # The graph prints as `class <lambda>(torch.nn.Module):`, which is no Python name.
    text = re.sub(r"\Aclass [^\n]*\n", "class Graph:\n", text)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {}
    forward = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    if forward is None:
        return {}
    params = [a.arg for a in forward.args.args if a.arg != "self"]
    comments = _comments(text.splitlines())
    views_of = {name: i for i, name in enumerate(params)}  # a name -> the input whose memory it is
    made_at: dict[str, Optional[_frames.Site]] = {}  # a name -> the site of the node that made it
    sites: dict[int, _frames.Site] = {}
    for statement in forward.body:
        value = getattr(statement, "value", None)
        if not isinstance(value, ast.Call) or not value.args:
            continue
        site = comments.get(statement.lineno)
        target = _target_name(statement)
        op = _op_name(value.func)
        first = value.args[0]
        source = views_of.get(first.id) if isinstance(first, ast.Name) else None
        if target is not None:
            made_at[target] = site
            if source is not None and op in _VIEWS:
                views_of[target] = source
        if source is None or not op.endswith("_") or op.endswith("__") or source in sites:
            continue
        if site is None:  # a write post-grad passes made: the site of the value it writes
            written = value.args[1] if len(value.args) > 1 else None
            site = made_at.get(written.id) if isinstance(written, ast.Name) else None
        if site is not None:
            sites[source] = site
    return sites


def _target_name(statement: ast.stmt) -> Optional[str]:
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
        return statement.targets[0].id
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return statement.target.id
    return None


def _op_name(func: ast.expr) -> str:
    """`copy_` for `torch.ops.aten.copy_.default`, `getitem` for `operator.getitem`."""
    names: list[str] = []
    while isinstance(func, ast.Attribute):
        names.append(func.attr)
        func = func.value
    if len(names) >= 2 and names[-1] == "ops":  # torch.ops.NAMESPACE.OP.OVERLOAD
        return names[-3] if len(names) >= 3 else ""
    return names[0] if names else ""


def _comments(lines: list[str]) -> dict[int, Optional[_frames.Site]]:
    """Line (1-based) -> the site FX's comment gives the statement there: FX prints a node's
    `# File: ...` only where it differs from the previous node's (`# No stacktrace found ...`
    where it has none), so each line has the nearest comment above it."""
    out: dict[int, Optional[_frames.Site]] = {}
    current: Optional[_frames.Site] = None
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            current = _frames.fx_comment_site(stripped) if "File:" in stripped else None
        elif stripped:
            out[number] = current
    return out
