"""The workbench's tests: `tests/<layer>/test_<module>.py` per module of `workbench/`, `tests/integration/` for launches
and checks across modules; shared helpers here (`tests.run_helpers`, `tests.neuron_standin`); docs/testing.md."""
