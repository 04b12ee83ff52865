"""Well-known intended writers: libraries that write weights or saved tensors on purpose, as data.

Each `Writer` names a library, the version range it was read in, the functions that make
the write, what they write and why that write is meant. Two ways of applying them:

- `how="scope"`: every write made while one of `functions` runs (found on the writing
  op's stack, as a `module:qualname` in `allow=` is) is allowed with no setting, counted
  as `intended writer NAME`, in the guards of its target (`weights`: `guard_module` and
  `KVGUARD_TARGETS=weights`; `autograd`: `guard_autograd`), when the installed version of
  the library is inside `versions`; outside it, the writes are reported as any other.
- `how="rule"`: kvguard's own code tells these writes apart (`where` names it); they are
  listed here so that the CLI (`python -m kvguard intended`) and the docs show every write
  let through with no setting.

A user's `allow=`, `KVGUARD_ALLOW` and `kvguard.allow()` still work beside them. Stdlib
only: the CLI lists them without importing torch.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
import types
from typing import Iterable, Optional

WEIGHTS = "weights"
AUTOGRAD = "autograd"


@dataclasses.dataclass(frozen=True)
class Writer:
    """One library's intended writes, where they are made and why they are meant."""

    name: str  # how reports and the exit line name it: `intended: peft LoRA merge`
    target: str  # WEIGHTS or AUTOGRAD: which guards let it write
    distribution: str  # the pip name whose installed version `versions` is checked against
    versions: str  # `>=0.21,<1`: where it was read and tested, and is applied
    read_in: str  # the version whose source was read
    functions: tuple[str, ...]  # `module:qualname`; `*` matches any run of characters
    writes: str  # what they write
    why: str  # why the write is meant
    how: str = "scope"  # "scope": applied on the stack, from this table; "rule": in kvguard's code
    where: str = ""  # for a rule: the code that applies it

    def applies(self) -> bool:
        """Whether the installed version (if any) is inside `versions`: a scope applies only then."""
        installed = _installed(self.distribution)
        return installed is None or in_range(installed, self.versions)


WRITERS: tuple[Writer, ...] = (
    Writer(
        "peft LoRA merge", WEIGHTS, "peft", ">=0.21,<1", "0.21.2",
        ("peft.tuners.*:*.merge", "peft.tuners.*:*.unmerge"),
        "the base layer's weight (and bias): `base_layer.weight.data += delta` (safe_merge=True: a merged copy, "
        "re-pointed with `base_layer.weight.data = merged`); unmerge subtracts it again",
        "merge_and_unload(), merge_adapter() and unmerge_adapter() fold the trained adapter into the base "
        "weights (trl's GRPO merges before each vLLM weight sync and unmerges after): the write the user asked for"),
    Writer(
        "peft LoRA initialisation from the base weights", WEIGHTS, "peft", ">=0.21,<1", "0.21.2",
        ("peft.tuners.lora.layer:*.pissa_init", "peft.tuners.lora.layer:*.olora_init",
         "peft.tuners.lora.layer:*.corda_init", "peft.tuners.lora.layer:*.loftq_init",
         "peft.tuners.lora.layer:*.lora_ga_init"),
        "the base layer's weight: `base_layer.weight.data = weight - scaling * B @ A` (PiSSA, OLoRA, CorDA, "
        "LoRA-GA), or its quantised form (LoftQ)",
        "get_peft_model() with init_lora_weights='pissa', 'olora', 'corda', 'loftq' or 'lora_ga' moves the "
        "principal part of each base weight into the adapter, so the model computes the same function: the "
        "re-initialisation the user asked for (a false alarm when the weights were watched since a "
        "load_state_dict())"),
    Writer(
        "torch's initialisers", WEIGHTS, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.init:*", "torch.nn.modules.*:*.reset_parameters", "torch.nn.modules.*:*.reset_running_stats"),
        "the tensor given (`torch.nn.init.normal_(w)`, `zeros_`, `orthogonal_` …), a module's own parameters "
        "and statistics (`Linear.reset_parameters()`, `BatchNorm.reset_running_stats()`)",
        "(re-)initialising a weight is the write the call asks for: a new head after a checkpoint was loaded, "
        "or a layer reset mid-training on purpose"),
    Writer(
        "transformers weight initialisation and embedding resize", WEIGHTS, "transformers", ">=5.25,<6", "5.25.0",
        ("transformers.initialization:*", "transformers.*:*._init_weights", "transformers.*:*._initialize_weights",
         "transformers.*:*.initialize_weights", "transformers.*:*.init_weights",
         "transformers.modeling_utils:*._resize_token_embeddings", "transformers.modeling_utils:*._get_resized_*"),
        "the weights `_init_weights` initialises (`initialization.normal_` …); an embedding or LM head "
        "re-pointed to its resized copy (`old_embeddings.weight.data = new_embeddings.weight.data`)",
        "post_init() and init_weights() initialise new modules; resize_token_embeddings() after adding tokens "
        "(a pad token, chat tokens) grows the embedding and head: both are what the user asked for, also after "
        "a load_state_dict()"),
    Writer(
        "trl SyncRefModelCallback", WEIGHTS, "trl", ">=1.16,<2", "1.16.0",
        ("trl.trainer.callbacks:SyncRefModelCallback._sync_target_model",),
        "every parameter of the reference model: `ref.data.mul_(1 - alpha).add_(policy.data, alpha=alpha)`",
        "TR-DPO / sync_ref_model=True (DPO, GRPO): the reference model is blended towards the policy every "
        "ref_model_sync_steps steps, by design"),
    Writer(
        "torch parametrizations", WEIGHTS, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.utils.parametrize:_maybe_set",),
        "a parametrized tensor's `original` (the module's own Parameter object), re-pointed with `original.set_(...)` "
        "(or torch.utils.swap_tensors): to `right_inverse(weight)` by register_parametrization(), to "
        "`right_inverse(value)` by `module.weight = value`, to the parametrized value by "
        "remove_parametrizations(leave_parametrized=True)",
        "torch.nn.utils.parametrize keeps the Parameter object through these so the optimizer need not be told: "
        "the re-initialisation the user asked for (PyTorch's test_parametrization.py stopped under raise)"),
    Writer(
        "torch lazy modules' initialisation", WEIGHTS, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.parameter:UninitializedTensorMixin.materialize", "torch.nn.modules.lazy:LazyModuleMixin._infer_parameters"),
        "an UninitializedParameter (or buffer) of a lazy module, re-pointed with `.data = torch.empty(shape)` "
        "when it is materialized, then initialised in place by the module's reset_parameters()",
        "a LazyLinear, LazyConv or LazyBatchNorm infers its shapes in its first forward; PyTorch lets the optimizer "
        "be made before that forward, over the uninitialized parameters, which become the real ones: their first "
        "values, not a change to weights anyone trained"),
    Writer(
        "torch.autograd.gradcheck perturbation", AUTOGRAD, "torch", ">=2.4,<3", "2.13.0",
        ("torch.autograd.gradcheck:_compute_numerical_gradient",),
        "each input element, through `.data`, while the analytical graph is alive; the original is copied back",
        "gradcheck and gradgradcheck compute numerical gradients by finite differences, and restore every "
        "element before backward reads it"),
    Writer(
        "batch norm and instance norm statistics", WEIGHTS, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.modules.batchnorm:_BatchNorm.forward", "torch.nn.modules.instancenorm:_InstanceNorm.forward"),
        "the module's running_mean, running_var and num_batches_tracked, in each training forward",
        "a module's own forward updating its own buffers (also: quantization observers' ranges, an Embedding "
        "with max_norm renormalising its weight)", how="rule",
        where="kvguard._protect.weights.ModuleSet._intended (the writing op's stack); at level light, "
              "kvguard._torch.updates_own_buffers (their fingerprints are taken again, not compared)"),
    Writer(
        "spectral norm's power iteration", WEIGHTS, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.utils.spectral_norm:SpectralNorm.__call__", "torch.nn.utils.parametrizations:_SpectralNorm.forward"),
        "weight_u and weight_v (torch.nn.utils.spectral_norm), _u and _v (parametrizations.spectral_norm), "
        "in each training forward",
        "the classic spectral_norm updates its vectors in a forward pre-hook, the parametrized one in its forward",
        how="rule", where="kvguard._protect.weights.ModuleSet._intended (a forward hook of the module writing "
                          "its buffers); at level light, kvguard._torch.updates_own_buffers"),
    Writer(
        "rrelu's noise", AUTOGRAD, "torch", ">=2.4,<3", "2.13.0",
        ("torch.nn.functional:rrelu", "torch.nn.modules.activation:RReLU.forward"),
        "the noise buffer autograd saved for the very op that fills it (rrelu_with_noise, in place or not)",
        "an argument an op writes but does not return bumps no version counter: autograd's own check never sees "
        "that write (batch norm's running statistics are the same), and backward reads the noise as filled",
        how="rule", where="kvguard._torch.op_facts (uncounted writes), kvguard._engine.judge"),
)


def scopes(target: str) -> tuple[Writer, ...]:
    """The scope writers the guards of `target` apply: those whose installed library is in range."""
    return tuple(w for w in WRITERS if w.how == "scope" and w.target == target and w.applies())


def running(writers: Iterable[Writer], frame: Optional[types.FrameType]) -> Optional[Writer]:
    """The first of `writers` one of whose functions is on the stack from `frame` up, or None."""
    compiled = [(w, _compiled(w.functions)) for w in writers]
    if not compiled:
        return None
    while frame is not None:
        code = frame.f_code
        module = frame.f_globals.get("__name__")
        if isinstance(module, str):
            qualname = getattr(code, "co_qualname", code.co_name)
            for writer, patterns in compiled:
                if any(m.match(module) and q.match(qualname) for m, q in patterns):
                    return writer
        frame = frame.f_back
    return None


@functools.lru_cache(maxsize=None)
def _compiled(functions: tuple[str, ...]) -> tuple[tuple[re.Pattern[str], re.Pattern[str]], ...]:
    out = []
    for function in functions:
        module, _, qualname = function.partition(":")
        out.append((re.compile(fnmatch.translate(module)), re.compile(fnmatch.translate(qualname))))
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
                     "so these writes are reported")
        head = textwrap.wrap(f"{writer.name} ({writer.target}; {writer.distribution} {writer.versions}, read in "
                             f"{writer.read_in}; {state})", width, subsequent_indent=" " * 9,
                             break_on_hyphens=False, break_long_words=False)
        rows = [("in", ", ".join(writer.functions)), ("writes", writer.writes), ("why", writer.why)]
        if writer.where:
            rows.append(("code", writer.where))
        for key, text in rows:
            head.extend(textwrap.wrap(text, width, initial_indent=f"  {key:<7}", subsequent_indent=" " * 9,
                                      break_on_hyphens=False, break_long_words=False))
        blocks.append("\n".join(head))
    intro = ("Writes kvguard lets through with no setting (weights: guard_module and KVGUARD_TARGETS=weights; "
             "autograd: guard_autograd and KVGUARD_TARGETS=autograd), counted at exit as 'intended writer NAME'. "
             "allow=, KVGUARD_ALLOW and kvguard.allow() add your own.")
    return "\n".join(textwrap.wrap(intro, width)) + "\n\n" + "\n\n".join(blocks)
