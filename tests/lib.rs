//! Shared helpers for the end-to-end tests live in this crate; the tests are under `tests/tests/`.
