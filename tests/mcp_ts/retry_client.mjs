// A tool call that times out at the client and is retried, with a TypeScript SDK
// (tests/test_mcp_cancels.py).
//
//   MCP_TS_DIR=DIR node retry_client.mjs URL PACKAGE FIRST_TIMEOUT_MS
//
// PACKAGE: "sdk" (@modelcontextprotocol/sdk, the 1.x line) or "client"
// (@modelcontextprotocol/client, the 2.x line, in its default legacy version negotiation).
// Calls send_slowly({to: "ops", seconds: 2}) with a FIRST_TIMEOUT_MS timeout (the SDK then
// sends notifications/cancelled), then the same call again with 30 s. Prints
// {"first": "<error>", "retry": "<text of the retry's result>"}.
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';

const [url, pkg, firstTimeout] = process.argv.slice(2);
const pkgDir = `${process.env.MCP_TS_DIR}/node_modules/@modelcontextprotocol/${pkg}`;
JSON.parse(readFileSync(`${pkgDir}/package.json`, 'utf8'));
let Client, StreamableHTTPClientTransport;
if (pkg === 'sdk') {
  ({ Client } = await import(pathToFileURL(`${pkgDir}/dist/esm/client/index.js`)));
  ({ StreamableHTTPClientTransport } = await import(pathToFileURL(`${pkgDir}/dist/esm/client/streamableHttp.js`)));
} else {
  ({ Client, StreamableHTTPClientTransport } = await import(pathToFileURL(`${pkgDir}/dist/index.mjs`)));
}

// The 1.x line takes (params, resultSchema, options), the 2.x line (params, options).
const callTool = (client, timeout) => {
  const params = { name: 'send_slowly', arguments: { to: 'ops', seconds: 2 } };
  return pkg === 'sdk'
    ? client.callTool(params, undefined, { timeout })
    : client.callTool(params, { timeout });
};

const client = new Client({ name: 'sluice-retry', version: '0' });
const transport = new StreamableHTTPClientTransport(new URL(url));
await client.connect(transport);
const out = {};
try {
  await callTool(client, Number(firstTimeout));
  out.first = 'answered';
} catch (e) {
  out.first = String(e?.message ?? e).slice(0, 200);
}
const result = await callTool(client, 30000);
out.retry = result.content[0].text;
await transport.terminateSession();
await client.close();
console.log(JSON.stringify(out));
process.exit(0);
