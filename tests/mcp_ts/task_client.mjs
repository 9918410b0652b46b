// N task-augmented calls of slow_task (3 s), 0.4 s apart, through Sluice with the TS SDK 1.x
// client (tests/test_mcp_tasks.py).   MCP_TS_DIR=DIR node task_client.mjs URL N
// Prints a JSON list: per call, the message types its callToolStream gave (or its error).
import { pathToFileURL } from 'node:url';
const [url, n] = process.argv.slice(2);
const base = `${process.env.MCP_TS_DIR}/node_modules/@modelcontextprotocol/sdk/dist/esm`;
const { Client } = await import(pathToFileURL(`${base}/client/index.js`));
const { StreamableHTTPClientTransport } = await import(pathToFileURL(`${base}/client/streamableHttp.js`));
const client = new Client({ name: 'h', version: '0' });
await client.connect(new StreamableHTTPClientTransport(new URL(url)));
const one = async (i) => { await new Promise(r => setTimeout(r, i * 400));
  const msgs = [];
  try { for await (const m of client.experimental.tasks.callToolStream({ name: 'slow_task', arguments: { seconds: 3 } }, undefined, { task: { ttl: 60000 } }))
      msgs.push(m.type === 'error' ? `error:${m.error?.code}:${m.error?.message}` : m.type); }
  catch (e) { msgs.push('raised:' + e.code + ':' + e.message); }
  return msgs.join(',');
};
const res = await Promise.all([...Array(Number(n)).keys()].map(one));
console.log(JSON.stringify(res));
await client.close(); process.exit(0);
