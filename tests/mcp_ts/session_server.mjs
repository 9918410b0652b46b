// A session-mode MCP server of the TypeScript SDK 1.x for tests. On a client's
// notifications/cancelled it aborts the tool and, as the spec says a receiver SHOULD, sends no
// response, leaving the call's SSE stream open. Tools: `slow(seconds)` (honours the cancel),
// `add(a, b)`. Usage: node session_server.mjs PORT_FILE LOG_FILE (listens on 127.0.0.1, a free
// port, written to PORT_FILE once listening; `slow start`, `slow aborted` lines go to
// LOG_FILE). MCP_TS_DIR holds node_modules with the SDK (.mcp-ts).
import http from "node:http";
import fs from "node:fs";
import { randomUUID } from "node:crypto";
import { pathToFileURL } from "node:url";

const base = `${process.env.MCP_TS_DIR}/node_modules`;
const load = (path) => import(pathToFileURL(`${base}/${path}`).href);
const { McpServer } = await load("@modelcontextprotocol/sdk/dist/esm/server/mcp.js");
const { StreamableHTTPServerTransport } = await load(
  "@modelcontextprotocol/sdk/dist/esm/server/streamableHttp.js");
const { z } = await load("zod/index.js");

const [portFile, logFile] = process.argv.slice(2);
const note = (line) => fs.appendFileSync(logFile, line + "\n");

function build() {
  const server = new McpServer({ name: "session-test", version: "1.0.0" });
  server.tool("slow", { seconds: z.number() }, async ({ seconds }, extra) => {
    note("slow start");
    await new Promise((resolve, reject) => {
      const timer = setTimeout(resolve, seconds * 1000);
      extra.signal.addEventListener("abort", () => {
        clearTimeout(timer);
        note("slow aborted");
        reject(new Error("aborted"));
      });
    });
    return { content: [{ type: "text", text: "slept" }] };
  });
  server.tool("add", { a: z.number(), b: z.number() },
              async ({ a, b }) => ({ content: [{ type: "text", text: String(a + b) }] }));
  return server;
}

const transports = {};
const httpServer = http.createServer(async (req, res) => {
  const chunks = [];
  for await (const c of req) chunks.push(c);
  const body = chunks.length ? JSON.parse(Buffer.concat(chunks).toString()) : undefined;
  const sid = req.headers["mcp-session-id"];
  let transport = sid ? transports[sid] : undefined;
  if (!transport) {
    if (sid) { res.writeHead(404).end(); return; }
    transport = new StreamableHTTPServerTransport({
      sessionIdGenerator: () => randomUUID(),
      onsessioninitialized: (id) => { transports[id] = transport; } });
    transport.onclose = () => { if (transport.sessionId) delete transports[transport.sessionId]; };
    await build().connect(transport);
  }
  await transport.handleRequest(req, res, body);
});
httpServer.listen(0, "127.0.0.1", () => {
  fs.writeFileSync(portFile, String(httpServer.address().port));
});
