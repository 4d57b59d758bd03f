//! What the stages read: prompt sets from files ([`prompt_files`]), the
//! rollout batch's columns typed ([`columns`]), where a prompt source
//! stands in its dataset ([`cursor`]), and groups of earlier runs' rollout
//! logs replayed in place of fresh generation ([`from_log`]).

pub mod columns;
pub mod cursor;
pub mod from_log;
pub mod prompt_files;
