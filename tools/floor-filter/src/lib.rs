//! The floor of `bench overhead`: the least a prefix router can do as a
//! proxy-wasm filter, so that each run shows how much of the added latency is
//! proxy-wasm in Envoy on that machine and how much is prefix-router.
//!
//! As the listener's HTTP filter it holds the request headers, reads the
//! first `prefix_length` bytes of the body once they are there (one host
//! call), and writes their xxh3 into `x-prefix-route-key` (one more). No JSON,
//! no tenant, no load tracking, no upstream position, no metrics. The plugin
//! configuration is the prefix length in bytes (`4096` when empty).
//!
//! Not a product: it routes every body by its raw first bytes, counts nothing
//! and never overflows.

#[cfg(target_arch = "wasm32")]
mod filter {
    use proxy_wasm::hostcalls;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

    const KEY_HEADER: &str = "x-prefix-route-key";
    const DEFAULT_PREFIX_LENGTH: usize = 4096;

    proxy_wasm::main! {{
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
            Box::new(FloorRoot { prefix_length: DEFAULT_PREFIX_LENGTH })
        });
    }}

    struct FloorRoot {
        prefix_length: usize,
    }

    impl Context for FloorRoot {}

    impl RootContext for FloorRoot {
        fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
            let text = self.get_plugin_configuration().unwrap_or_default();
            let text = String::from_utf8_lossy(&text);
            match text.trim() {
                "" => true,
                number => match number.parse() {
                    Ok(prefix_length) => {
                        self.prefix_length = prefix_length;
                        true
                    }
                    Err(_) => {
                        let message = format!("floor filter: {number:?} is not a byte count");
                        let _ = hostcalls::log(LogLevel::Error, &message);
                        false
                    }
                },
            }
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(FloorRequest {
                prefix_length: self.prefix_length,
                keyed: false,
            }))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct FloorRequest {
        prefix_length: usize,
        /// The key is written once; later body callbacks pass through.
        keyed: bool,
    }

    impl Context for FloorRequest {}

    impl HttpContext for FloorRequest {
        fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
            if end_of_stream {
                Action::Continue
            } else {
                Action::Pause
            }
        }

        fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
            if self.keyed {
                return Action::Continue;
            }
            if body_size < self.prefix_length && !end_of_stream {
                return Action::Pause;
            }
            self.keyed = true;
            let len = body_size.min(self.prefix_length);
            if let Ok(Some(prefix)) = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, len) {
                let key = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&prefix));
                let _ =
                    hostcalls::set_map_value(MapType::HttpRequestHeaders, KEY_HEADER, Some(&key));
            }
            Action::Continue
        }
    }
}
