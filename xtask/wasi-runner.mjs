// Runs a wasm32-wasip1 test or bench binary under Node's WASI, so `cargo test
// --target wasm32-wasip1` exercises the filter core as 32-bit wasm (and
// `cargo bench --bench per_request --target wasm32-wasip1` times it in V8).
// Cargo invokes: node wasi-runner.mjs <binary.wasm> [test args...]
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';
import { argv, env, exit } from 'node:process';

const [, , wasmPath, ...args] = argv;
const wasi = new WASI({
  version: 'preview1',
  args: [wasmPath, ...args],
  env,
  preopens: { '.': '.' },
  returnOnExit: true,
});
const module = await WebAssembly.compile(await readFile(wasmPath));
// A benchmark binary links the whole library, proxy-wasm glue included, so it
// imports the host ABI (`env.proxy_*`) without ever calling it outside Envoy:
// each such import is a function that fails loudly if it is called.
const host = {};
for (const { module: from, name, kind } of WebAssembly.Module.imports(module)) {
  if (from === 'env' && kind === 'function') {
    host[name] = () => {
      throw new Error(`proxy-wasm host call ${name} outside Envoy`);
    };
  }
}
const instance = await WebAssembly.instantiate(module, {
  ...wasi.getImportObject(),
  env: host,
});
// The library's proxy-wasm entry point (`_initialize`, which Envoy calls) is
// exported next to the binary's `_start`; Node's WASI refuses a module with
// both, and a test or bench never needs the former.
const { _initialize, ...exports } = instance.exports;
exit(wasi.start({ exports }));
