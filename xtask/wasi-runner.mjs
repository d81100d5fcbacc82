// Runs a wasm32-wasip1 test binary under Node's WASI, so `cargo test
// --target wasm32-wasip1` exercises the filter core as 32-bit wasm.
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
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
exit(wasi.start(instance));
