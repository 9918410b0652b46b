// One MCP client session, as bench/mcp_refusals.py drives it, with a TypeScript SDK.
//
//   MCP_TS_DIR=DIR node client.mjs URL PACKAGE MODE SLOW_S [notify|plain] [CALL_TIMEOUT_S]
//
// PACKAGE: "sdk" (@modelcontextprotocol/sdk, the 1.x line) or "client" (@modelcontextprotocol/client,
// the 2.x line), both installed under DIR/node_modules. MODE: "legacy" or "auto" (2.x
// versionNegotiation; the 1.x line ignores it). Same scenario and output as client.py.
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';

const [url, pkg, mode, slowArg, notifyArg, timeoutArg] = process.argv.slice(2);
const CALL_TIMEOUT_MS = 1000 * Number(timeoutArg ?? 6);
const base = process.env.MCP_TS_DIR;
const t0 = performance.now();
const at = () => Math.round((performance.now() - t0) / 10) / 100;
const calls = {};
const errors = [];

const pkgDir = `${base}/node_modules/@modelcontextprotocol/${pkg}`;
const pkgVersion = JSON.parse(readFileSync(`${pkgDir}/package.json`, 'utf8')).version;
let Client, StreamableHTTPClientTransport;
if (pkg === 'sdk') {
  ({ Client } = await import(pathToFileURL(`${pkgDir}/dist/esm/client/index.js`)));
  ({ StreamableHTTPClientTransport } = await import(pathToFileURL(`${pkgDir}/dist/esm/client/streamableHttp.js`)));
} else {
  ({ Client, StreamableHTTPClientTransport } = await import(pathToFileURL(`${pkgDir}/dist/index.mjs`)));
}

function describe(e) {
  return { type: e?.constructor?.name, code: e?.code, message: String(e?.message ?? e).slice(0, 200), data: e?.data };
}

async function call(client, key, name, args) {
  calls[key] = { outcome: 'pending' };
  try {
    // The 1.x line takes (params, resultSchema, options), the 2.x line (params, options).
    const options = { timeout: CALL_TIMEOUT_MS };
    const r = pkg === 'sdk'
      ? await client.callTool({ name, arguments: args }, undefined, options)
      : await client.callTool({ name, arguments: args }, options);
    calls[key] = { outcome: 'ok', is_error: r.isError ?? false };
  } catch (e) {
    const timedOut = e?.code === -32001 || /timed out|timeout/i.test(String(e?.message));
    calls[key] = timedOut ? { outcome: 'timeout', error: describe(e) } : { outcome: 'raised', error: describe(e) };
  }
  calls[key].at_s = at();
}

const options = pkg === 'client' && mode === 'auto' ? { versionNegotiation: { mode: 'auto' } } : {};
const client = new Client({ name: 'sluice-probe', version: '0' }, options);
const transport = new StreamableHTTPClientTransport(new URL(url));
client.onerror = (e) => errors.push({ at_s: at(), ...describe(e) });
let sessionError = null;
try {
  await client.connect(transport);
  if (notifyArg === 'notify') await call(client, 'notify', 'notify', {});
  const slow = Number(slowArg);
  const tasks = [call(client, 'slow_1', 'slow', { seconds: slow }), call(client, 'slow_2', 'slow', { seconds: slow })];
  await new Promise((r) => setTimeout(r, 300));
  await call(client, 'refused', 'send', { to: 'alice', body: 'hello' });
  await Promise.all(tasks);
  await call(client, 'after', 'add', { a: 1, b: 2 });
  await client.close();
} catch (e) {
  sessionError = describe(e);
}
console.log(JSON.stringify({
  client: `ts ${pkg === 'sdk' ? '@modelcontextprotocol/sdk' : '@modelcontextprotocol/client'} ${pkgVersion}` + (pkg === 'client' ? ` mode=${mode}` : ''),
  calls, session_error: sessionError, transport_errors: errors, elapsed_s: at(),
}));
process.exit(0);
