//! What an adapter loaded for this model is checked against.

use super::Model;
use crate::lora::LoraBase;

impl Model {
    /// Whether the model has an output projection of its own (`output.weight`), rather than
    /// one tied to the token embeddings; only then can an adapter change it.
    pub fn has_own_output(&self) -> bool {
        self.output.is_some()
    }

    /// The shapes an adapter for this model must have, kept apart from the weights so a
    /// server can check adapters loaded at run time after the model moved into its engine.
    pub fn lora_base(&self) -> LoraBase {
        LoraBase {
            config: self.config.clone(),
            own_output: self.has_own_output(),
        }
    }
}
