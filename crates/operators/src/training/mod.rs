//! The trainers' row handling, beneath every trainer stage: a step's rows
//! as the learner reads them and cut into micro-batches ([`learn_rows`]),
//! prompt + response rows packed for the forward and backward passes
//! ([`sequences`]), and the optimizer step every trainer shares
//! ([`train_step`]).

pub(crate) mod learn_rows;
pub mod sequences;
pub mod train_step;
