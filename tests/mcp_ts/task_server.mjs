// TS SDK 1.x session server with a task-augmented tool (experimental tasks, 2025-11-25).
// (tests/test_mcp_tasks.py)   MCP_TS_DIR=DIR node task_server.mjs PORT_FILE STATS_FILE
// STATS_FILE: {running, maxRunning, runs} of slow_task, rewritten as they change.
import http from "node:http"; import fs from "node:fs"; import { randomUUID } from "node:crypto";
import { pathToFileURL } from "node:url";
const base = `${process.env.MCP_TS_DIR}/node_modules/@modelcontextprotocol/sdk/dist/esm`;
const load = (p) => import(pathToFileURL(`${base}/${p}`).href);
const { McpServer } = await load("server/mcp.js");
const { StreamableHTTPServerTransport } = await load("server/streamableHttp.js");
const { InMemoryTaskStore, InMemoryTaskMessageQueue } = await load("experimental/tasks/stores/in-memory.js");
const { z } = await import(pathToFileURL(`${process.env.MCP_TS_DIR}/node_modules/zod/index.js`).href);
const [portFile, statsFile] = process.argv.slice(2);
const taskStore = new InMemoryTaskStore();
let running = 0, maxRunning = 0, runs = 0;
const stat = () => fs.writeFileSync(statsFile, JSON.stringify({ running, maxRunning, runs }));
stat();
function build() {
  const server = new McpServer({ name: "tasks", version: "1" }, {
    capabilities: { tasks: { requests: { tools: { call: {} } } } }, taskStore, taskMessageQueue: new InMemoryTaskMessageQueue() });
  server.experimental.tasks.registerToolTask("slow_task", { inputSchema: { seconds: z.number() } }, {
    async createTask({ seconds }, { taskStore, taskRequestedTtl }) {
      const task = await taskStore.createTask({ ttl: taskRequestedTtl ?? 60000 });
      running++; runs++; maxRunning = Math.max(maxRunning, running); stat();
      (async () => {
        await new Promise((r) => setTimeout(r, seconds * 1000));
        running--; stat();
        await taskStore.storeTaskResult(task.taskId, "completed", { content: [{ type: "text", text: "done" }] });
      })();
      return { task };
    },
    async getTask(_a, { taskId, taskStore }) { return await taskStore.getTask(taskId); },
    async getTaskResult(_a, { taskId, taskStore }) { return await taskStore.getTaskResult(taskId); },
  });
  return server;
}
const transports = {};
http.createServer(async (req, res) => {
  const chunks = []; for await (const c of req) chunks.push(c);
  const body = chunks.length ? JSON.parse(Buffer.concat(chunks).toString()) : undefined;
  const sid = req.headers["mcp-session-id"]; let t = sid ? transports[sid] : undefined;
  if (!t) {
    t = new StreamableHTTPServerTransport({ sessionIdGenerator: () => randomUUID(), onsessioninitialized: (id) => { transports[id] = t; } });
    await build().connect(t);
  }
  await t.handleRequest(req, res, body);
}).listen(0, "127.0.0.1", function () { fs.writeFileSync(portFile, String(this.address().port)); });
