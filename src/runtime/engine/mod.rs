//! The serving engine: continuous batching over a paged KV cache with prefix caching, one
//! step at a time on every rank. [`api`] is what clients (the HTTP server, `tpc run`) see.

pub mod api;
