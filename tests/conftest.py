"""Shared test fixtures: every test must leave torch as it found it, under every engine.

No dispatch mode left on the stack, and `torch.utils.swap_tensors` (which an active
guard wraps) restored: a guard left open by one test would otherwise change the next.

The tests of what a guard sees run once per engine (`compiled`, `kernels`, `mode`,
see `kvguard._engine.choice`): the `engine` fixture sets `KVGUARD_ENGINE` for the test.
Where the compiled engine cannot be built the tests skip, except under CI, where
they fail: CI has a compiler.

The README's quick command (`-m 'not slow'`) runs each such test under one engine, chosen
from the test's id (stable as tests come and go, each engine a share of every module); the
other engines' runs are marked `slow`, so CI's second tier (`-m slow`) completes the
matrix. A test whose outcome differs between engines (`every_engine`) runs under each in
both. Where the one engine chosen is not available here, the quick run uses another
rather than skip, so no behaviour goes untested on a machine without a compiler.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

from kvguard._native import build as _build

# Every subprocess a test starts uses the compiled engine this session built: pytester points
# HOME at a fresh directory, where the default cache holds none (a 15 s build per subprocess).
os.environ.setdefault("KVGUARD_CACHE_DIR", str(_build.cache_root()))
# An xdist worker gets COLUMNS=80 and LINES=24 of its own, which its subprocesses would
# inherit (rich output 80 wide): the tests see the environment the run was started with.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("COLUMNS") == "80" and os.environ.get("LINES") == "24":
    del os.environ["COLUMNS"], os.environ["LINES"]

ENGINES = ("compiled", "kernels", "mode")
# Modules whose tests are about what a guard sees and does: each runs under every engine.
# The others (reports, CLI, start-up, integrations) run under the automatic choice.
PER_ENGINE = {"test_guard", "test_channels", "test_odd_tensors", "test_never_crash", "test_containers",
              "test_fingerprints", "test_cliffs", "test_undeclared_writes", "test_property", "test_engines",
              "test_placements", "test_autograd", "test_weights", "test_shared_memory"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "any_engine: in a per-engine module, run once under the automatic choice")
    config.addinivalue_line("markers", "every_engine: its outcome differs between engines: the quick run "
                            "(-m 'not slow') runs it under every engine, not one")
    config.addinivalue_line("markers", "slow: left out of the README's test command (-m 'not slow'), run by CI "
                            "(-m slow): many processes or a whole tool run, the other engines' runs of a "
                            "per-engine test, start-up variants (QUICK_LEAVES_OUT)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if (metafunc.module.__name__.rpartition(".")[2] in PER_ENGINE and "engine" in metafunc.fixturenames
            and metafunc.definition.get_closest_marker("any_engine") is None):
        metafunc.parametrize("engine", ENGINES, indirect=True)


# Left out of the README's quick command (-m 'not slow'), run by CI's slow tier: a test id
# (all its parameters) or an id with parameters, and why. Each starts fresh Python processes
# (about 3 CPU-seconds each, torch's import) or runs a whole tool (a C++ build, a wheel,
# a benchmark, two ranks); what it checks is a scenario or a variant of a behaviour that a
# test the quick command keeps (named here) checks too, in-process or in one such process.
QUICK_LEAVES_OUT = {
    # builds of the compiled hook (real compiles, or a compiler that fails): tool runs
    "test_cli.py::test_a_failed_build_is_remembered_until_rebuild": "a build",
    "test_cli.py::test_build_without_a_compiler_is_one_line_and_exit_1": "a build",
    "test_cli.py::test_engines_without_a_compiler": "a build",
    "test_cli.py::test_a_built_hook_that_does_not_load_fails_the_build": "a build",
    "test_cli.py::test_build_finds_the_cached_hook": "a build",
    "test_write_hook.py::test_a_failed_build_is_remembered": "a build",
    "test_write_hook.py::test_build_without_a_compiler_returns_none_with_a_reason": "a build",
    "test_write_hook.py::test_two_processes_building_together_build_once_and_both_load": "two builds",
    "test_write_hook.py::test_the_compiler_gets_the_cxx_standard_torch_was_built_as": "a build",
    "test_write_hook.py::test_a_compiler_without_torchs_standard_builds_as_cxx17": "two builds",
    "test_engines.py::test_without_a_compiler_the_kernels_engine_guards": "a build",
    "test_engines.py::test_without_a_compiler_and_no_cxx_the_reason_says_set_cxx": "a build",
    "test_engines.py::test_the_compiled_engine_in_a_fresh_process": "the engines' processes; kept: the engine fixture",
    # tool runs and measurements over many steps
    "test_undeclared_writes.py::test_subset_finds_no_undeclared_write_missing_from_the_table":
        "a sweep over op_db (tools/sweep_undeclared_writes.py); kept: each entry point of the table",
    "test_autograd.py::test_memory_is_flat_over_many_steps": "450 steps; kept: test_a_loop_with_no_write_op_keeps_no_entries_of_freed_graphs",
    "test_ray.py": "a Ray cluster per test",
    "test_startup.py": "a wheel build and a fresh venv; kept: test_importhook's .pth line and activation",
    "test_pytest_plugin.py::test_no_kvguard_with_every_installed_plugin": "kept: the plugin's off switch in-process",
    # measured costs: timing and memory bounds (a loaded machine fails a timing bound), in
    # processes of their own; the exactness of what they measure is in quick tests
    "test_cost_bounds.py": "timing bounds over 100,000 tensors",
    "test_cliffs.py::test_logits_overlap_costs_no_memory": "memory measured in a fresh process",
    "test_placements.py::test_a_placement_costs_the_same_late_as_early": "a timing bound over 2,000 placements",
    "test_cliffs.py::test_a_reported_row_write_copies_the_row": "memory measured in a fresh process",
    "test_cliffs.py::test_one_element_written_in_a_64_mb_tensor_copies_one_element": "memory measured in a fresh process",
    "test_cliffs.py::test_a_whole_write_costs_one_copy_plus_bounded_temporaries": "memory measured in a fresh process",
    "test_cli.py::test_engines_says_what_is_available_and_what_a_guard_would_use": "kept: the engine fixture, test_engines' bad engine name",
    "test_pytest_plugin.py::test_off_count_under_xdist": "an xdist run inside; kept: the off count without it",
    "test_records.py::test_without_the_c_digest_the_compiled_describe_leaves_digests_to_python": "a variant without the C helper",
    "test_weights_activation.py::test_a_process_that_made_no_optimizer_says_so": "a variant of the exit line",
    "test_diagnostics.py::test_static_and_class_method_targets": "kept: test_importhook's targets",
    # whole tool runs: benchmarks, the GPU check, a wheel, torchrun and gloo ranks, the docs site
    "test_benchmark.py": "benchmark runs",
    "test_bench_suite.py": "benchmark runs",
    "test_gpu_check.py": "the GPU check's runs",
    "test_fingerprints.py::test_dtensor_on_two_gloo_processes": "two gloo ranks",
    "test_docs.py::test_mkdocs_build_strict": "the site's build (CI has the docs extra)",
    "test_readme_flow.py::test_demo_then_tests_then_env_var_section": "the README's flow; kept: test_examples",
    "test_docs.py::test_samples_run": "the docs' samples; kept: test_examples, the README's quick start",
    "test_cli.py::test_run_chains_to_the_next_sitecustomize": "a variant of kvguard run",
    "test_cli.py::test_action_spelling_is_case_insensitive": "kept: test_importhook's test_action_spellings",
    "test_presets.py::test_verl_preset_walks_dataproto_into_its_tensordict": "a preset's scenario (imports tensordict)",
    "test_presets.py::test_slime_at_624b824a_moved_log_rollout_data_and_is_clean": "a variant of a preset",
    "test_presets.py::test_nemo_rl_span_writes_after_the_fix_are_allowed_with_no_setting": "a variant of a preset",
    "test_reports.py::test_file_cap_keeps_counts_exact": "a variant of report files",
    "test_reports.py::test_unguarded_calls_are_counted": "a variant of the summary",
    "test_reports.py::test_a_process_without_summary_is_not_proof": "a variant of kvguard report",
    "test_reports.py::test_malformed_lines_are_named_and_the_rest_is_read": "a variant of kvguard report",
    "test_autograd_activation.py::test_a_clean_run_says_what_it_watched": "kept: the weights switch's clean loop",
    "test_examples.py::test_fixed_variant_is_clean": "the README's flow (slow) runs it",
    "test_examples.py::test_raise_variant_stops_at_the_first_write": "kept: test_autograd_activation's raise",
    "test_importhook.py::test_startup_is_idempotent": "a variant of start-up",
    "test_docs.py::test_report_fields_are_the_documented_ones": "kept: test_reports' schema of records",
    # variants of a start-up behaviour one kept test checks in a fresh process
    "test_cli.py::test_a_broken_next_sitecustomize_fails_as_without_kvguard": "a variant of kvguard run",
    "test_cli.py::test_install_pth_from_a_checkout_without_the_integration_is_quiet": "a variant of a checkout",
    "test_cli.py::test_run_from_a_checkout_without_the_integration_is_quiet": "a variant of a checkout",
    "test_cli.py::test_report_through_head": "kept: test_report_into_a_closed_pipe_is_quiet",
    "test_cli.py::test_a_broken_installed_integration_is_one_line_an_absent_one_none": "a variant of start-up",
    "test_settings.py::test_a_bad_variable_is_one_not_activated_line_and_the_job_runs[KVGUARD_FINGERPRINT-maybe]":
        "kept: KVGUARD_ENGINE",
    "test_settings.py::test_a_bad_variable_is_one_not_activated_line_and_the_job_runs[KVGUARD_LEVEL-fast]":
        "kept: KVGUARD_ENGINE",
    "test_settings.py::test_a_bad_variable_is_one_not_activated_line_and_the_job_runs[KVGUARD_MAX_EVENTS-many]":
        "kept: KVGUARD_ENGINE",
    "test_settings.py::test_a_target_keeps_the_settings_it_started_with": "a variant of settings",
    "test_settings.py::test_header_records_the_settings": "kept: test_env_settings_apply_to_targets_and_to_guards_in_code_alike",
    "test_settings.py::test_pytest_plugin_guards_take_the_settings": "kept: test_env_settings_apply_to_targets_and_to_guards_in_code_alike",
    "test_diagnostics.py::test_warn_prints_the_panel_and_no_default_warning_display[flags1]": "kept: flags0",
    "test_diagnostics.py::test_warn_prints_the_panel_and_no_default_warning_display[flags2]": "kept: flags0",
    "test_diagnostics.py::test_a_guard_warning_keeps_its_default_display": "a variant of warn",
    "test_diagnostics.py::test_an_unusable_report_dir_is_one_line_at_start_and_the_job_runs_on":
        "kept: test_a_report_dir_that_breaks_mid_job_never_replaces_the_mutation_error",
    "test_diagnostics.py::test_light_level_from_the_environment": "kept: test_env_settings_apply_to_targets_and_to_guards_in_code_alike",
    "test_diagnostics.py::test_the_warning_still_reaches_catch_warnings_and_logging": "a variant of warn",
    "test_diagnostics.py::test_this_install_ships_the_pth_file": "kept: every start-up test (they need it)",
    "test_diagnostics.py::test_warn_under_w_error_is_no_exception_and_one_panel": "a variant of warn",
    "test_diagnostics.py::test_warn_under_w_error_runs_the_job_to_the_end": "a variant of warn",
    "test_diagnostics.py::test_in_pytest_the_warning_is_in_the_warnings_summary_and_error_never_breaks_the_op":
        "kept: test_pytest_plugin (in-process pytest runs)",
    "test_reports.py::test_explicit_guards_decorators_and_pytest_write_report_files": "kept: test_fixed_job_leaves_a_header_and_summary_that_prove_it_clean",
    "test_reports.py::test_two_launches_into_one_directory_stay_two_runs": "a variant of report files",
    "test_reports.py::test_long_job_prints_one_panel_per_site_and_a_short_bounded_report": "a variant of the summary",
    "test_reports.py::test_every_record_of_a_process_carries_one_run_id_and_rank": "a variant of report files",
    "test_reports.py::test_env_allow_counts_allowed_writes_in_the_summary_and_report": "kept: test_allow (in-process)",
    "test_importhook.py::test_keys_and_ignore_from_the_environment": "a variant of targets",
    "test_importhook.py::test_a_main_script_target_says_why_and_what_to_do": "a variant of targets",
    "test_importhook.py::test_a_main_target_defined_before_late_activation_is_guarded": "a variant of targets",
    "test_importhook.py::test_an_argument_that_holds_no_tensor_is_said_at_the_first_call": "a variant of targets",
    "test_importhook.py::test_some_calls_unguardable_and_others_guarded_are_both_said": "a variant of targets",
    "test_async_targets.py::test_an_uncaught_error_from_an_env_target_ends_at_the_writing_line":
        "kept: test_never_crash's uncaught error traceback",
    "test_async_targets.py::test_an_env_target_coroutine_interleaved_with_itself": "kept: test_the_repro_as_env_targets",
    "test_presets.py::test_openrlhf_intended_penalty_writes_are_allowed_as_the_preset_says": "a preset's scenario",
    "test_presets.py::test_functions_missing_in_older_versions_are_one_line_each_at_exit": "a variant of a preset",
    # real-world scenarios of the weights and autograd switches; kept: the clean loop, the stray
    # write, a process without an optimizer, and the autograd switch's raise and clean run
    "test_weights_activation.py::test_a_named_weight_sync_is_intended_and_a_write_between_syncs_is_not": "a scenario",
    "test_weights_activation.py::test_a_realistic_fine_tuning_loop_is_clean_under_autograd_and_weights": "a scenario",
    "test_weights_activation.py::test_an_optimizers_weights_are_let_go_when_it_is_freed_and_a_loaded_copy_is_watched":
        "a scenario",
    "test_weights_activation.py::test_converting_the_model_at_the_end_of_training_is_not_a_finding": "a scenario",
    "test_weights_activation.py::test_prime_rl_2482_aliased_buffer_over_reloaded_weights_no_optimizer": "a scenario",
    "test_weights_activation.py::test_the_docs_example_stops_at_the_stray_write": "a scenario",
    "test_weights_activation.py::test_verl_6688_lora_views_of_a_reused_ipc_buffer_no_optimizer": "a scenario",
    "test_weights_activation.py::test_weights_and_autograd_together": "a scenario",
    "test_autograd_activation.py::test_torch_func_runs_under_the_env_var": "a scenario",
    "test_autograd_activation.py::test_record_lets_backward_fail_as_torch_does_with_the_write_named": "a variant of record",
    "test_autograd_activation.py::test_report_files_and_kvguard_report": "kept: test_reports",
    # real dependencies and scenarios whose behaviour a kept test checks more cheaply
    "integrations/test_megatron.py::test_one_process_gets_megatron_tags_only_while_initialised":
        "real megatron-core on gloo (a 10 CPU-second process); kept: the integration's tags and stage checks "
        "on a stand-in parallel_state (test_megatron_pipeline)",
    "test_weights_activation.py::test_a_stray_write_between_steps_is_stopped_on_the_env_var_alone":
        "kept: test_data_assignment's Megatron-Bridge shape (KVGUARD=raise KVGUARD_TARGETS=weights stops a "
        "stray weight write at its line), test_newcomer's exit lines after a write between steps",
    "test_weights_trust.py::test_frames_without_dict_are_searched_under_the_env_switch":
        "kept: test_attributes_of_slotted_and_hostile_objects, and the switch under pytest (pluggy's slotted "
        "HookCaller among the caller frames)",
    "test_reports.py::test_fixed_job_leaves_a_header_and_summary_that_prove_it_clean":
        "kept: test_records_carry_the_schema_and_the_readme_names_every_field (a job's files), "
        "test_a_consistent_clean_summary_is_clean_and_names_what_it_watched",
    "test_presets.py::test_nemo_rl_span_writes_through_expanded_advantages_are_caught_where_allowed":
        "a preset's scenario; kept: test_alias_writes (in-process), the slime preset's run",
    "integrations/test_megatron_schedule.py::test_protection_still_open_at_exit_is_checked_then":
        "a process's exit; kept: the schedule's in-process tests, test_never_crash's exit checks",
    "test_async_targets.py::test_the_repro_as_env_targets":
        "kept: the async targets' in-process tests, test_importhook's env targets in a fresh process",
    "test_newcomer.py::test_autograd_and_weights_exit_lines_name_the_forward_pass_and_the_optimizer_step":
        "kept: test_a_process_guards_site_line_without_a_moment_names_only_the_first_path (the words, "
        "in-process), the weights switch's clean loop and the autograd switch's raise (each in a fresh process)",
}


def _left_out(item: pytest.Item) -> bool:
    rel = item.nodeid.partition("tests/")[2]
    return not QUICK_LEAVES_OUT.keys().isdisjoint((rel, rel.partition("[")[0], rel.partition("::")[0]))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under the README's command, a module it leaves out whole is not even imported.

    Importing is what collecting costs each worker: Ray's import, a benchmark's.
    """
    if config.getoption("markexpr", "") == "not slow" and collection_path.name in QUICK_LEAVES_OUT:
        return True
    return None


# The fixtures that take an engine as their parameter (`engine` here, and modules' own).
ENGINE_PARAMS = ("engine", "each_engine")


def _engine_of(item: pytest.Item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name in ENGINE_PARAMS:
        if params.get(name) in ENGINES:
            return str(params[name])
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One engine per test in the quick run, the others in the slow tier (see the docstring)."""
    groups: dict[str, list[tuple[pytest.Item, str]]] = {}
    for item in items:
        if _left_out(item):
            item.add_marker(pytest.mark.slow)
            continue
        name = _engine_of(item)
        if name is None or item.get_closest_marker("every_engine") is not None:
            continue
        base, _, ids = item.nodeid.partition("[")
        parts = ids.rstrip("]").split("-")
        parts.remove(name)
        groups.setdefault(base + "[" + "-".join(parts) + "]", []).append((item, name))
    for key, members in groups.items():
        if len(members) < 2:
            continue
        present = sorted({name for _, name in members}, key=ENGINES.index)
        chosen = present[zlib.crc32(key.encode()) % len(present)]
        for item, name in members:
            if name == chosen:
                item.stash[_QUICK] = True
            else:
                item.add_marker(pytest.mark.slow)


_QUICK = pytest.StashKey[bool]()


def _stand_in(name: str) -> str | None:
    """The engine a quick run uses where `name` is not available here (None: none is)."""
    from kvguard._engine import choice as _choice

    return next((other for other in ENGINES if other != name and _choice.why_not(other) is None), None)


@pytest.fixture(autouse=True)
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The engine this test's guards use (`auto` outside the per-engine modules)."""
    name = getattr(request, "param", None)
    if name is None:
        return os.environ.get("KVGUARD_ENGINE") or "auto"
    from kvguard._engine import choice as _choice

    why = _choice.why_not(name)
    if why is not None:
        if os.environ.get("CI") and name == "compiled":
            pytest.fail(f"the compiled engine is not available under CI: {why}")
        other = _stand_in(name) if request.node.stash.get(_QUICK, False) else None
        if other is None:
            pytest.skip(f"the {name} engine is not available here: {why}")
        name = other  # this test's one engine in the quick run: run it under another, not skip it
    monkeypatch.setenv("KVGUARD_ENGINE", name)
    if name != "compiled":  # as where there is no compiler: the protected set reads tensors in Python too
        from kvguard._protect import records as _records

        monkeypatch.setattr(_records, "compiled_describe", lambda: None)
    return name


@pytest.fixture(autouse=True)
def no_leaked_guard():
    before = torch._C._len_torch_dispatch_stack()
    swap = torch.utils.swap_tensors
    yield
    assert torch._C._len_torch_dispatch_stack() == before, "a dispatch mode leaked out of the test"
    assert torch.utils.swap_tensors is swap, "a guard was left open: swap_tensors is still wrapped"
    from kvguard._engine import choice as _choice

    leaked = [hook.name for hook in _choice._hook_engines.values() if hook.judges]
    for hook in _choice._hook_engines.values():  # so that one leak fails one test, not all after it
        for judge in list(hook.judges):
            hook.detach(judge)
    assert not leaked, f"a guard was left attached to the {', '.join(leaked)} engine"
