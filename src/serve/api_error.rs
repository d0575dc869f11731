//! Errors as OpenAI's API reports them: a status and `{"error": {"message", "type", "param",
//! "code"}}`, the shape the `openai` client turns into its exceptions.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// One refused or failed request.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 about one parameter of the request.
    pub fn param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// 400 about the request as a whole.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn model_not_found(asked: &str, served: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "the model `{asked}` does not exist here; this server serves `{served}` (see GET /v1/models)"
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "the request body is larger than this server's limit of {limit} bytes; send a shorter prompt"
            ),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 503: the engine takes no request now (full queue, shutting down).
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable_error",
            param: None,
            code: None,
        }
    }

    /// 500: the engine failed while running the request.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn not_found_path(path: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no endpoint at {path}; this server has POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health and GET /metrics"),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn method_not_allowed() -> ApiError {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: "this endpoint does not take that method: the /v1/…/completions endpoints take POST, the others GET".into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// The `{"error": …}` object, also sent as an event inside a stream.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        (
            self.status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}
