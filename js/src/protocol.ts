/**
 * The wire protocol between the gpumem kernel side and this front-end
 * extension. The kernel side is src/gpumem/panel/frontend.py (the module
 * gpumem.panel.frontend, whose docstring is the reference); the status
 * payload is built by gpumem.panel.frontend.status_payload. Keep them in sync.
 * Pure (no DOM, no JupyterLab at run time): js/test/ tests it.
 */

/** Output mime type asking the front end to dock a panel in the sidebar. */
export const SIDEBAR_MIME = 'application/vnd.gpumem.sidebar+json';

/** ipywidgets' view mime type. */
export const WIDGET_VIEW_MIME = 'application/vnd.jupyter.widget-view+json';

/** Comm target carrying the status-bar figures (both directions may open it). */
export const STATUS_TARGET = 'gpumem.status';

/** Data of a SIDEBAR_MIME output. */
export interface ISidebarData {
  /** ipywidgets model id of the panel to dock. */
  model_id: string;
}

/** The panel model id in the data of a SIDEBAR_MIME output; null when it has none. */
export function readSidebarData(data: unknown): string | null {
  const modelId =
    typeof data === 'object' && data !== null
      ? (data as Partial<Record<keyof ISidebarData, unknown>>).model_id
      : undefined;
  return typeof modelId === 'string' && modelId !== '' ? modelId : null;
}

/** One CUDA device as seen by the kernel's PyTorch allocator. */
export interface IDeviceStatus {
  index: number;
  name?: string;
  allocated_bytes: number;
  reserved_bytes?: number;
  total_bytes?: number | null;
}

/** A status payload sent by the kernel about once a second. */
export interface IStatusPayload {
  devices: IDeviceStatus[];
  host?: { rss_bytes?: number | null };
  cuda_in_use: boolean;
  /** Model id of the kernel's live sidebar panel, when it has one: a page may dock it. */
  docked_model_id?: string | null;
}

/**
 * Front end -> kernel requests on the status comm. `keepalive` is sent every
 * KEEPALIVE_MS so the kernel can drop comms of pages that went away; `bye`
 * when the page goes away (reload, tab closed), so that the kernel stops
 * counting the widget views of this page at once (they are never removed one
 * by one then).
 */
export const REQUESTS = ['snapshot', 'sidebar', 'keepalive', 'bye'] as const;

export type FrontendRequest = { request: (typeof REQUESTS)[number] };

export const KEEPALIVE_MS = 30000;

export function isStatusPayload(data: unknown): data is IStatusPayload {
  return (
    typeof data === 'object' &&
    data !== null &&
    Array.isArray((data as IStatusPayload).devices)
  );
}

/** What the kernel said in answer to a sidebar request. */
export interface ISidebarAnswer {
  modelId?: string;
  error?: string;
}

/** A message from the kernel on the status comm, read; null for one this front end does not know. */
export type StatusCommMessage =
  | { kind: 'status'; payload: IStatusPayload }
  | { kind: 'sidebar'; answer: ISidebarAnswer };

/**
 * Reads the data of a kernel -> front end message on the status comm: a
 * status payload, `{"sidebar_model_id": ...}` or `{"sidebar_error": ...}`.
 */
export function readStatusComm(data: unknown): StatusCommMessage | null {
  if (isStatusPayload(data)) {
    return { kind: 'status', payload: data };
  }
  if (typeof data !== 'object' || data === null) {
    return null;
  }
  const d = data as { sidebar_model_id?: unknown; sidebar_error?: unknown };
  if (typeof d.sidebar_model_id === 'string') {
    return { kind: 'sidebar', answer: { modelId: d.sidebar_model_id } };
  }
  if (typeof d.sidebar_error === 'string') {
    return { kind: 'sidebar', answer: { error: d.sidebar_error } };
  }
  return null;
}

/** The iopub messages whose data may hold a SIDEBAR_MIME output. */
const OUTPUT_TYPES = new Set([
  'display_data',
  'execute_result',
  'update_display_data'
]);

/**
 * The panel model id of a SIDEBAR_MIME output in an iopub message of type
 * `msgType` with `content`, or null when it holds none.
 */
export function sidebarOutputModelId(
  msgType: string,
  content: unknown
): string | null {
  if (!OUTPUT_TYPES.has(msgType) || typeof content !== 'object' || !content) {
    return null;
  }
  const data = (content as { data?: Record<string, unknown> }).data;
  return readSidebarData(data?.[SIDEBAR_MIME]);
}

/** How many sidebar outputs a kernel connection remembers as fresh. */
const MAX_FRESH_OUTPUTS = 32;

/**
 * The model ids of the SIDEBAR_MIME outputs that arrived from a kernel and
 * were not rendered yet (as opposed to outputs restored from a saved
 * notebook): the newest MAX_FRESH_OUTPUTS, each taken once.
 */
export class FreshOutputs {
  add(modelId: string): void {
    this._ids.delete(modelId); // a repeated id counts from its latest arrival
    this._ids.add(modelId);
    for (const oldest of this._ids) {
      if (this._ids.size <= MAX_FRESH_OUTPUTS) {
        break;
      }
      this._ids.delete(oldest);
    }
  }

  has(modelId: string): boolean {
    return this._ids.has(modelId);
  }

  /** Whether `modelId` was fresh; it no longer is. */
  take(modelId: string): boolean {
    return this._ids.delete(modelId);
  }

  clear(): void {
    this._ids.clear();
  }

  private _ids = new Set<string>();
}
