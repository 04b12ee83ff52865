"""Well-known intended writers: libraries that write weights or saved tensors on purpose, as data.

Each `Writer` names a library, the version range it was read in, the functions that make
the write, what they write and why that write is meant. Two ways of applying them:

- `how="scope"`: a write made while one of `functions` runs (found on the writing op's
  stack, as a `module:qualname` in `allow=` is) *to a tensor that function is meant to
  write* is allowed with no setting, counted as `intended writer NAME`, in the guards of
  its target (`weights`: `guard_module` and `KVGUARD_TARGETS=weights`; `autograd`:
  `guard_autograd`), when the installed version of the library is inside `versions`.
  What a function is meant to write is named after it, as the arguments that hold it:
  `merge(self)` may write the tensors of its own module (every parameter and buffer of
  `self` and its submodules), `normal_(tensor)` the tensor given, `_init_weights(module|m|self)`
  those of the first of these arguments the function has. Any other write made while it
  runs (a `reset_parameters()` that also zeroes another module's weight) is reported as
  any other. Outside `versions`, the writes are reported, with a hint naming the writer
  and the versions it was read in (`hint`).
- `how="rule"`: kvguard's own code tells these writes apart (`where` names it); they are
  listed here so that the CLI (`python -m kvguard intended`) and the docs show every write
  let through with no setting.

A user's `allow=`, `KVGUARD_ALLOW` and `kvguard.allow()` still work beside them. Stdlib
only at import: the CLI lists them without importing torch (torch is imported only to
judge a write, which torch made).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
import types
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple, Optional, Sequence

if TYPE_CHECKING:
    import torch

WEIGHTS = "weights"
AUTOGRAD = "autograd"


@dataclasses.dataclass(frozen=True)
class Writer:
    """One library's intended writes, where they are made and why they are meant."""

    name: str  # how reports and the exit line name it: `intended: peft LoRA merge`
    target: str  # WEIGHTS or AUTOGRAD: which guards let it write
    distribution: str  # the pip name whose installed version `versions` is checked against
    versions: str  # `>=0.10,<1`: where it was read (and where tested), and is applied
    read_in: str  # the versions whose source was read, comma-separated: `0.10.0, 0.13.2, 0.21.2`
    # `module:qualname` (`*` matches any run of characters), then what the function is meant to
    # write: `(self)`, `(tensor)`, `(module|m|self)` (the first of these arguments it has); with no
    # parentheses, every write made while it runs (the rules, whose code judges the tensor)
    functions: tuple[str, ...]
    writes: str  # what they write
    why: str  # why the write is meant
    how: str = "scope"  # "scope": applied on the stack, from this table; "rule": in kvguard's code
    where: str = ""  # for a rule: the code that applies it
    tested: str = ""  # the versions the real-library jobs ran clean in (tests/test_real_libraries.py, per line)

    def applies(self) -> bool:
        """Whether the installed version (if any) is inside `versions`: a scope applies only then."""
        installed = _installed(self.distribution)
        return installed is None or in_range(installed, self.versions)


# The versions each library's writers were read in (the functions named, at each version: the same
# writes, by the same functions, to the same arguments' tensors; see docs/weights.md).
_PEFT_READ = "0.10.0, 0.11.1, 0.12.0, 0.13.2, 0.14.0, 0.15.2, 0.16.0, 0.17.1, 0.18.1, 0.19.1, 0.20.0, 0.21.2"
_TRANSFORMERS_READ = ("4.40.2, 4.43.4, 4.46.3, 4.49.0, 4.51.3, 4.53.3, 4.55.4, 4.57.1, 4.57.6, 5.0.0, 5.5.0, 5.5.4, "
                      "5.6.0, 5.8.1, 5.10.4, 5.15.0, 5.20.2, 5.25.0")
_TRL_READ = ("0.9.6, 0.10.1, 0.11.4, 0.12.2, 0.13.0, 0.15.2, 0.17.0, 0.19.1, 0.21.0, 0.23.1, 0.24.0, 0.26.2, 0.29.1, "
             "1.0.0, 1.8.0, 1.16.0")

WRITERS: tuple[Writer, ...] = (
    Writer(
        "peft LoRA merge", WEIGHTS, "peft", ">=0.10,<1", _PEFT_READ,
        ("peft.tuners.*:*.merge(self)", "peft.tuners.*:*.unmerge(self)"),
        "the base layer's weight (and bias) of the adapter layer merged: `base_layer.weight.data += delta` "
        "(peft 0.10 and 0.11: `base_layer.weight.data = base_layer.weight.data + delta`; safe_merge=True: a "
        "merged copy, re-pointed with `base_layer.weight.data = merged`); unmerge subtracts it again",
        "merge_and_unload(), merge_adapter() and unmerge_adapter() fold the trained adapter into the base "
        "weights (trl's GRPO merges before each vLLM weight sync and unmerges after): the write the user asked for",
        tested="0.13.2, 0.17.1, 0.19.1, 0.21.2"),
    Writer(
        "peft LoRA initialisation from the base weights", WEIGHTS, "peft", ">=0.10,<1", _PEFT_READ,
        ("peft.tuners.lora.layer:*.pissa_init(self)", "peft.tuners.lora.layer:*.olora_init(self)",
         "peft.tuners.lora.layer:*.corda_init(self)", "peft.tuners.lora.layer:*.loftq_init(self)",
         "peft.tuners.lora.layer:*.lora_ga_init(self)"),
        "the base layer's weight of the adapter layer initialised: `base_layer.weight.data = weight - scaling * "
        "B @ A` (PiSSA from peft 0.11, OLoRA from 0.12, CorDA from 0.15, LoRA-GA from 0.19), or its quantised "
        "form (LoftQ)",
        "get_peft_model() with init_lora_weights='pissa', 'olora', 'corda', 'loftq' or 'lora_ga' moves the "
        "principal part of each base weight into the adapter, so the model computes the same function: the "
        "re-initialisation the user asked for (a false alarm when the weights were watched since a "
        "load_state_dict())",
        tested="0.13.2, 0.17.1, 0.19.1, 0.21.2"),
    Writer(
        "torch's initialisers", WEIGHTS, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.init:*(tensor)", "torch.nn.modules.*:*.reset_parameters(self)",
         "torch.nn.modules.*:*.reset_running_stats(self)"),
        "the tensor given (`torch.nn.init.normal_(w)`, `zeros_`, `orthogonal_` …), a torch module's own "
        "parameters and statistics (`Linear.reset_parameters()`, `BatchNorm.reset_running_stats()`)",
        "(re-)initialising a weight is the write the call asks for: a new head after a checkpoint was loaded, "
        "or a layer reset mid-training on purpose",
        tested="2.13.0"),
    Writer(
        "transformers weight initialisation and embedding resize", WEIGHTS, "transformers", ">=4.40,<6",
        _TRANSFORMERS_READ,
        ("transformers.initialization:*(tensor)", "transformers.*:*._init_weights(module|m|self)",
         "transformers.*:*._initialize_weights(module)", "transformers.*:*.initialize_weights(self)",
         "transformers.*:*.init_weights(self)", "transformers.modeling_utils:*.resize_token_embeddings(self)",
         "transformers.modeling_utils:*._resize_token_embeddings(self)",
         "transformers.modeling_utils:*._get_resized_embeddings(old_embeddings)",
         "transformers.modeling_utils:*._get_resized_lm_head(old_lm_head)"),
        "the weights of the module `_init_weights` initialises (5.x: `initialization.normal_(module.weight)` …; "
        "4.x: `module.weight.data.normal_()` …); the old embedding and LM head re-pointed to their resized "
        "copies (`old_embeddings.weight.data = new_embeddings.weight.data`, from 4.43; 4.40-4.42 put a new "
        "module in their place), then tied again",
        "post_init() and init_weights() initialise new modules; resize_token_embeddings() after adding tokens "
        "(a pad token, chat tokens) grows the embedding and head: both are what the user asked for, also after "
        "a load_state_dict()",
        tested="4.46.3, 4.57.1, 5.10.4, 5.15.0, 5.25.0"),
    Writer(
        "trl SyncRefModelCallback", WEIGHTS, "trl", ">=0.9,<2", _TRL_READ,
        ("trl.trainer.callbacks:SyncRefModelCallback._sync_target_model(target_model)",
         "trl.trainer.utils:SyncRefModelCallback._sync_target_model(target_model)"),
        "every parameter of the reference model: `ref.data.mul_(1 - alpha).add_(policy.data, alpha=alpha)` "
        "(in trl.trainer.utils up to 0.9, trl.trainer.callbacks from 0.10)",
        "TR-DPO / sync_ref_model=True (DPO, GRPO): the reference model is blended towards the policy every "
        "ref_model_sync_steps steps, by design",
        tested="0.12.2, 0.24.0, 1.16.0"),
    Writer(
        "torch parametrizations", WEIGHTS, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.utils.parametrize:_maybe_set(dest)",),
        "a parametrized tensor's `original` (the module's own Parameter object), re-pointed with `original.set_(...)` "
        "(or torch.utils.swap_tensors): to `right_inverse(weight)` by register_parametrization(), to "
        "`right_inverse(value)` by `module.weight = value`, to the parametrized value by "
        "remove_parametrizations(leave_parametrized=True)",
        "torch.nn.utils.parametrize keeps the Parameter object through these so the optimizer need not be told: "
        "the re-initialisation the user asked for (PyTorch's test_parametrization.py stopped under raise)",
        tested="2.13.0"),
    Writer(
        "torch lazy modules' initialisation", WEIGHTS, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.parameter:UninitializedTensorMixin.materialize(self)",
         "torch.nn.modules.lazy:LazyModuleMixin._infer_parameters(self)"),
        "an UninitializedParameter (or buffer) of a lazy module, re-pointed with `.data = torch.empty(shape)` "
        "when it is materialized, then initialised in place by the module's reset_parameters(): the lazy "
        "module's own parameters and buffers (and its submodules'), not another module's",
        "a LazyLinear, LazyConv or LazyBatchNorm infers its shapes in its first forward; PyTorch lets the optimizer "
        "be made before that forward, over the uninitialized parameters, which become the real ones: their first "
        "values, not a change to weights anyone trained",
        tested="2.13.0"),
    Writer(
        "vLLM post-load transform", WEIGHTS, "vllm", ">=0.10,<1", "0.34.0",
        ("vllm.model_executor.model_loader.utils:process_weights_after_loading(model)",
         "vllm.model_executor.model_loader.weight_utils:finalize_model_weights(model)",
         "vllm.model_executor.layers.quantization.*:*.process_weights_after_loading(layer)"),
        "the weights of the model (or of the layer) just loaded, transformed in place into the form its kernels "
        "read: quantized, repacked, transposed, rescaled (`process_weights_after_loading`, each quantization "
        "method's own; `finalize_model_weights`, every module's own post-load hook), also inside a reload",
        "vLLM loads checkpoint-format weights, then converts them for its kernels: a second write to what the "
        "load just wrote, by design (`written_twice` inside a load, a write to watched weights after one)",
    ),
    Writer(
        "sglang post-load transform", WEIGHTS, "sglang", ">=0.4,<1", "0.5.23",
        ("sglang.srt.model_loader.loader:post_load_weights(model)",
         "sglang.srt.model_loader.loader:*.postprocess_weights(model)",
         "sglang.srt.model_loader.loader:*.restore_weights_before_loading(model)",
         "sglang.srt.models.*:*.post_load_weights(self)",
         "sglang.srt.layers.quantization.*:*.process_weights_after_loading(layer)",
         "sglang.srt.layers.quantization.*:*.restore_weights_before_loading(layer)"),
        "the model's (or the layer's) weights after a load: its post-load fix-ups, the quantization packing, and "
        "undoing that packing before the next load",
        "sglang packs weights for its kernels after each load and unpacks them before the next "
        "(`WeightUpdater.begin_weight_update` / `end_weight_update`): writes to the weights by design",
    ),
    Writer(
        "torch.autograd.gradcheck perturbation", AUTOGRAD, "torch", ">=2.4,<3", "2.13.0",
        ("torch.autograd.gradcheck:_compute_numerical_gradient(entry)",),
        "each input element, through `.data`, while the analytical graph is alive; the original is copied back "
        "(the saved tensors sharing memory with the element perturbed, not what the checked function writes)",
        "gradcheck and gradgradcheck compute numerical gradients by finite differences, and restore every "
        "element before backward reads it",
        tested="2.13.0"),
    Writer(
        "batch norm and instance norm statistics", WEIGHTS, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.modules.batchnorm:_BatchNorm.forward", "torch.nn.modules.instancenorm:_InstanceNorm.forward"),
        "the module's running_mean, running_var and num_batches_tracked, in each training forward",
        "a module's own forward updating its own buffers (also: quantization observers' ranges, an Embedding "
        "with max_norm renormalising its weight)", how="rule",
        where="kvguard._protect.weights_writers.IntendedWritesSet._intended (the writing op's stack); "
              "at level light, kvguard._torch.training.updates_own_buffers (their fingerprints are taken again, "
              "not compared)"),
    Writer(
        "spectral norm's power iteration", WEIGHTS, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.utils.spectral_norm:SpectralNorm.__call__", "torch.nn.utils.parametrizations:_SpectralNorm.forward"),
        "weight_u and weight_v (torch.nn.utils.spectral_norm), _u and _v (parametrizations.spectral_norm), "
        "in each training forward",
        "the classic spectral_norm updates its vectors in a forward pre-hook, the parametrized one in its forward",
        how="rule", where="kvguard._protect.weights_writers.IntendedWritesSet._intended (a forward hook of the "
                          "module writing its buffers); at level light, kvguard._torch.training.updates_own_buffers"),
    Writer(
        "rrelu's noise", AUTOGRAD, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.functional:rrelu", "torch.nn.modules.activation:RReLU.forward"),
        "the noise buffer autograd saved for the very op that fills it (rrelu_with_noise, in place or not)",
        "an argument an op writes but does not return bumps no version counter: autograd's own check never sees "
        "that write (batch norm's running statistics are the same), and backward reads the noise as filled",
        how="rule", where="kvguard._torch.ops.op_facts (uncounted writes), kvguard._engine.judge"),
)


def scopes(target: str) -> tuple[Writer, ...]:
    """The scope writers the guards of `target` apply: those whose installed library is in range."""
    return tuple(w for w in WRITERS if w.how == "scope" and w.target == target and w.applies())


def unread(target: str) -> tuple[Writer, ...]:
    """The scope writers of `target` not applied here: their library is installed in a version outside
    the range they were read in. A write they make is reported, with `hint`."""
    return tuple(w for w in WRITERS if w.how == "scope" and w.target == target and not w.applies())


class Found(NamedTuple):
    """A writer found running, and the frame's function that makes it so."""

    writer: Writer
    function: str  # `module:qualname`, as `allow=` and KVGUARD_ALLOW name a scope


# What a write reaches, asked only when a writer's function is found on the stack: the
# protected tensors at the written path (one for a model's weights).
Reached = Callable[[], Sequence["torch.Tensor"]]
# Whether two tensors share an element's memory: the protected set's exact test
# (`kvguard._protect.geometry.elements_overlap`), passed in, as a leaf imports no room.
Overlap = Callable[["torch.Tensor", "torch.Tensor"], bool]


def writing(writers: Iterable[Writer], frame: Optional[types.FrameType], reached: Reached,
            overlap: Overlap) -> Optional[Found]:
    """The innermost of `writers`' functions on the stack from `frame` up that is meant to write what
    the write reaches (`reached()`: the tensors written), or None.

    A function named with arguments (`merge(self)`) is meant to write the tensors those hold:
    a tensor given, or every parameter and buffer of a module given (its submodules' too). A
    write to anything else made while it runs is not its write: the walk goes on outwards (an
    outer writer may own it), and ends with None. With no arguments named, any write is its.
    """
    compiled = [(w, _compiled(w.functions)) for w in writers]
    if not compiled:
        return None
    tensors: Optional[Sequence[torch.Tensor]] = None
    while frame is not None:
        module = frame.f_globals.get("__name__")
        if isinstance(module, str):
            qualname = None  # found once a pattern's module matches: on Python 3.10 that reads the frame
            for writer, patterns in compiled:
                for module_re, qualname_re, names in patterns:
                    if not module_re.match(module):
                        continue
                    if qualname is None:
                        qualname = code_qualname(frame)
                    if not qualname_re.match(qualname):
                        continue
                    if names is not None:
                        if tensors is None:
                            tensors = _tensors(reached)
                        if not _holds(_argument(frame, names), tensors, overlap):
                            continue
                    return Found(writer, f"{module}:{qualname}")
        frame = frame.f_back
    return None


def hint(found: Found) -> str:
    """What a write by a writer not applied here says: who wrote it, where the writer was read, and the fix."""
    writer = found.writer
    installed = _installed(writer.distribution)
    read = [v.strip() for v in writer.read_in.split(",") if v.strip()]
    where = read[0] if len(read) == 1 else f"{len(read)} versions, {read[0]} to {read[-1]}"
    return (f"written by {found.function}: {writer.name}, an intended writer kvguard lets through in "
            f"{writer.distribution} {writer.versions} (read in {where}); {writer.distribution} {installed} is "
            f"installed here, whose code was not read, so the write is reported. If it is meant, allow it: "
            f"allow=['{found.function}'] or KVGUARD_ALLOW={found.function}")


def _argument(frame: types.FrameType, names: tuple[str, ...]) -> object:
    """The value of the first of `names` bound in `frame` (None if none is)."""
    values = frame.f_locals
    for name in names:
        if name in values:
            return values[name]
    return None


def _tensors(reached: Reached) -> Sequence[torch.Tensor]:
    try:
        return tuple(reached())
    except Exception:  # noqa: BLE001 - not known: no scoped writer owns the write, which is reported
        return ()


def _holds(value: Any, tensors: Sequence[torch.Tensor], overlap: Overlap) -> bool:  # value: whatever the frame held
    """Whether `value` (a tensor, or a module's parameters and buffers) holds one of `tensors`: the
    same tensor object, or one sharing an element's memory with it (`w.data`, a view)."""
    if not tensors or value is None:
        return False
    import torch

    try:
        if issubclass(type(value), torch.Tensor):  # `type()`: a value may refuse attribute reads
            own = [value]
        elif issubclass(type(value), torch.nn.Module):
            own = [*value.parameters(), *value.buffers()]
        else:
            return False
    except Exception:  # noqa: BLE001 - a module whose walk fails: it holds nothing known
        return False
    if any(t is o for t in tensors for o in own):
        return True
    for t in tensors:
        for o in own:
            try:
                if overlap(o, t):
                    return True
            except Exception:  # noqa: BLE001 - no memory to compare (uninitialized, meta): not the same
                continue
    return False


@functools.lru_cache(maxsize=None)
def _compiled(functions: tuple[str, ...]) -> tuple[tuple[re.Pattern[str], re.Pattern[str], Optional[tuple[str, ...]]],
                                                   ...]:
    out = []
    for function in functions:
        name, paren, arguments = function.partition("(")
        module, _, qualname = name.partition(":")
        names = tuple(a.strip() for a in arguments.rstrip(")").split("|")) if paren else None
        out.append((re.compile(fnmatch.translate(module)), re.compile(fnmatch.translate(qualname)), names))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _installed(distribution: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except Exception:  # noqa: BLE001 - not installed (or unreadable): its functions never run here
        return None


def _release(version: str) -> tuple[int, ...]:
    """`2.13.0+cpu` -> (2, 13, 0); `1.0.0rc1` -> (1, 0, 0): the numeric release, enough for a range."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group(0)))
        if digits.group(0) != part:
            break
    return tuple(parts)


def in_range(version: str, versions: str) -> bool:
    """Whether `version` satisfies every `>=X` and `<Y` of `versions` (`>=0.21,<1`)."""
    have = _release(version)
    for clause in filter(None, (c.strip() for c in versions.split(","))):
        op, bound = (clause[:2], clause[2:]) if clause.startswith(">=") else (clause[:1], clause[1:])
        edge = _release(bound.strip())
        width = max(len(have), len(edge))
        left, right = have + (0,) * (width - len(have)), edge + (0,) * (width - len(edge))
        if (op == ">=" and left < right) or (op == "<" and not left < right):
            return False
    return True


def describe(width: int = 100) -> str:
    """What `python -m kvguard intended` prints: each writer, what it writes, why, and whether it applies here."""
    import textwrap

    blocks = []
    for writer in WRITERS:
        installed = _installed(writer.distribution)
        if writer.how == "rule":
            state = "built into kvguard"
        elif installed is None:
            state = f"{writer.distribution} not installed here"
        else:
            state = (f"applied: {writer.distribution} {installed} installed" if writer.applies() else
                     f"not applied: {writer.distribution} {installed} installed is outside {writer.versions}, "
                     "so these writes are reported, with a hint naming this writer")
        head = textwrap.wrap(f"{writer.name} ({writer.target}; {writer.distribution} {writer.versions}; {state})",
                             width, subsequent_indent=" " * 11, break_on_hyphens=False, break_long_words=False)
        rows = [("in", ", ".join(writer.functions)), ("writes", writer.writes), ("why", writer.why),
                ("read in", writer.read_in)]
        if writer.tested:
            rows.append(("tested", writer.tested))
        if writer.where:
            rows.append(("code", writer.where))
        for key, text in rows:
            head.extend(textwrap.wrap(text, width, initial_indent=f"  {key:<9}", subsequent_indent=" " * 11,
                                      break_on_hyphens=False, break_long_words=False))
        blocks.append("\n".join(head))
    intro = ("Writes kvguard lets through with no setting (weights: guard_module and KVGUARD_TARGETS=weights; "
             "autograd: guard_autograd and KVGUARD_TARGETS=autograd), counted at exit as 'intended writer NAME'. "
             "Each function is followed by what it may write: the tensors its arguments hold ((self): its own "
             "module's parameters and buffers; a|b: the first of these it has). allow=, KVGUARD_ALLOW and "
             "kvguard.allow() add your own.")
    return "\n".join(textwrap.wrap(intro, width)) + "\n\n" + "\n\n".join(blocks)


def code_qualname(frame: types.FrameType) -> str:
    """The qualified name of the function `frame` runs (`Linear.reset_parameters`), as patterns name it.

    `co_qualname` from Python 3.11. On 3.10 code objects carry the bare name only: a method's
    class is the one in the MRO of its first argument (`self`, `cls`) whose attribute of that
    name runs this code (through `staticmethod`, `classmethod` and `functools.wraps`
    decorators); a module's function is its global of that name; else the bare name.
    """
    code = frame.f_code
    qualname = getattr(code, "co_qualname", None)
    if isinstance(qualname, str):
        return qualname
    name = code.co_name
    if code.co_argcount:
        first = frame.f_locals.get(code.co_varnames[0])
        for klass in (first if isinstance(first, type) else type(first)).__mro__:
            if _runs(klass.__dict__.get(name), code):
                return f"{klass.__qualname__}.{name}"
    found: Any = frame.f_globals.get(name)
    return str(found.__qualname__) if _runs(found, code) else name


def _runs(value: object, code: types.CodeType) -> bool:
    value = getattr(value, "__func__", value)  # a staticmethod or classmethod
    for _ in range(8):  # a decorated function: the function it wraps runs
        if value is None:
            return False
        if getattr(value, "__code__", None) is code:
            return True
        value = getattr(value, "__wrapped__", None)
    return False
