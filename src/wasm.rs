//! The proxy-wasm glue: Envoy's callbacks forwarded to [`crate::plugin`],
//! which decides everything over the [`AbiHost`]; each callback returns the
//! plugin's [`Flow`] as an `Action`. Nothing else lives here, so that every
//! behaviour is tested natively with an in-memory host.

use std::cell::RefCell;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

use crate::host::AbiHost;
use crate::plugin::{Flow, PluginRoot, Stream, Vm};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(RootGlue(PluginRoot::default()))
    });
}}

thread_local! {
    /// This worker VM's state, shared by all its root and HTTP contexts.
    static VM: RefCell<Vm<AbiHost>> = RefCell::new(Vm::new(AbiHost));
}

/// Runs `f` on the VM's state. Envoy calls into a VM one callback at a time
/// and defers what could call back into it (a local reply is sent after the
/// callback returns); should a callback still come while another holds the
/// state, it does nothing (`otherwise`) rather than panic and kill the VM.
fn with_vm<R>(otherwise: R, f: impl FnOnce(&mut Vm<AbiHost>) -> R) -> R {
    VM.with(|cell| match cell.try_borrow_mut() {
        Ok(mut vm) => f(&mut vm),
        Err(_) => {
            log::error!("prefix-router: re-entrant host callback ignored");
            otherwise
        }
    })
}

fn action(flow: Flow) -> Action {
    match flow {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
    }
}

struct RootGlue(PluginRoot);

impl Context for RootGlue {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        with_vm((), |vm| {
            self.0
                .http_call_response(vm, token_id, num_headers, body_size)
        });
    }
}

impl RootContext for RootGlue {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        with_vm(false, |vm| self.0.configure(vm, plugin_configuration_size))
    }

    fn on_tick(&mut self) {
        with_vm((), |vm| self.0.tick(vm));
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(StreamGlue(self.0.new_stream())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct StreamGlue(Stream);

impl Context for StreamGlue {
    fn on_done(&mut self) -> bool {
        with_vm((), |vm| self.0.on_done(vm));
        true
    }
}

impl HttpContext for StreamGlue {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(with_vm(Flow::Continue, |vm| {
            self.0.on_request_headers(vm, end_of_stream)
        }))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(with_vm(Flow::Continue, |vm| {
            self.0.on_request_body(vm, body_size, end_of_stream)
        }))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        action(with_vm(Flow::Continue, |vm| self.0.on_request_trailers(vm)))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        action(with_vm(Flow::Continue, |vm| self.0.on_response_headers(vm)))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(with_vm(Flow::Continue, |vm| {
            self.0.on_response_body(vm, body_size, end_of_stream)
        }))
    }
}
