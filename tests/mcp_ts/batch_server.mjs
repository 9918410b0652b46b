// A stateless MCP server of the TypeScript SDK 1.x (which still accepts JSON-RPC batches at
// protocol 2025-03-26) for tests: tool `send(to)` appends a line to COUNT_FILE; `slow(seconds)`.
// Usage: node batch_server.mjs PORT_FILE COUNT_FILE  (listens on 127.0.0.1, a free port,
// written to PORT_FILE once listening). MCP_TS_DIR holds node_modules with the SDK (.mcp-ts).
import http from "node:http";
import fs from "node:fs";
import { pathToFileURL } from "node:url";

const base = `${process.env.MCP_TS_DIR}/node_modules`;
const load = (path) => import(pathToFileURL(`${base}/${path}`).href);
const { McpServer } = await load("@modelcontextprotocol/sdk/dist/esm/server/mcp.js");
const { StreamableHTTPServerTransport } = await load(
  "@modelcontextprotocol/sdk/dist/esm/server/streamableHttp.js");
const { z } = await load("zod/index.js");

const [portFile, countFile] = process.argv.slice(2);

function build() {
  const server = new McpServer({ name: "batch-test", version: "1.0.0" });
  server.tool("send", { to: z.string() }, async ({ to }) => {
    fs.appendFileSync(countFile, JSON.stringify({ to }) + "\n");
    return { content: [{ type: "text", text: "sent" }] };
  });
  server.tool("slow", { seconds: z.number() }, async ({ seconds }) => {
    await new Promise((r) => setTimeout(r, seconds * 1000));
    return { content: [{ type: "text", text: "slept" }] };
  });
  return server;
}

const httpServer = http.createServer(async (req, res) => {
  const chunks = [];
  for await (const c of req) chunks.push(c);
  const body = chunks.length ? JSON.parse(Buffer.concat(chunks).toString()) : undefined;
  const server = build();
  const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined,
                                                        enableJsonResponse: true });
  res.on("close", () => { transport.close(); server.close(); });
  await server.connect(transport);
  await transport.handleRequest(req, res, body);
});
httpServer.listen(0, "127.0.0.1", () => {
  fs.writeFileSync(portFile, String(httpServer.address().port));
});
