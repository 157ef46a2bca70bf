//! Multi-process oxrl as one test binary (one link instead of three on CI's two cores):
//! `launchers` — `oxrl dist-check` under torchrun and each launcher's variables; `training` —
//! data-parallel `oxrl train` (ZeRO-2) against one process; `python` — the Python package and
//! its Ray launcher.

mod launchers;
mod python;
mod training;
