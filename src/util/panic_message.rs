//! The text of a panic, for the errors that report one.

use std::any::Any;

/// The message of a caught panic (`panic!("…")` carries a `&str` or a
/// `String`); another payload gets a placeholder.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_string()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic payload that is not a string".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_and_str_payloads_give_their_text() {
        let payload = std::panic::catch_unwind(|| panic!("at {}", 3)).unwrap_err();
        assert_eq!(panic_message(payload.as_ref()), "at 3");
        let payload = std::panic::catch_unwind(|| panic!("plain")).unwrap_err();
        assert_eq!(panic_message(payload.as_ref()), "plain");
        let payload = std::panic::catch_unwind(|| std::panic::panic_any(7)).unwrap_err();
        assert_eq!(
            panic_message(payload.as_ref()),
            "a panic payload that is not a string"
        );
    }
}
